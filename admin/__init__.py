"""Admin: two rooms. ``store``: the registry store (adapters, tenants and their keys, rate limits, usage; SQLite or
Redis) and its change feed, which every request's tenant check reads. ``api``: the admin API, the HTTP router that
changes the store and the engine's adapters together, and ``ApiError``. ``api`` imports ``store``, never the reverse."""
