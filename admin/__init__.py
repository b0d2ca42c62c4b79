"""Admin API, tenants, rate limits and the registry store (the HTTP serving issue)."""
