"""The flags of ``lora-server bench serve``: every flag of ``vllm bench serve`` (vLLM's benchmarks/serve.py and its
dataset parser), with vLLM's names and defaults, plus our own (tenant keys, multi-turn conversations, rate sweeps).
A vLLM flag that means nothing against this client is still known: giving it is an error that says why
(docs/bench-serve.md holds the same list as a table, which a test checks against this parser)."""

from __future__ import annotations

import argparse
import json
import math
import uuid
from typing import Any

from lora_server.bench.serve_metrics import CLIENT_QUEUE_METRICS, METRICS

SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
BACKENDS = ("openai", "vllm", "openai-chat")  # vllm: vLLM's name for the completions API, as openai
DATASETS = ("random", "prefix_repetition", "custom", "multi-turn")
# vLLM's datasets that are not offered, and why
OTHER_DATASETS = {
    "sharegpt": "needs the ShareGPT JSON and a tokenizer to filter its conversations",
    "burstgpt": "needs the BurstGPT trace file",
    "sonnet": "needs vLLM's sonnet.txt and a chat-templating tokenizer",
    "hf": "downloads a Hugging Face dataset",
    "spec_bench": "downloads SpecBench",
    "txt-slices": "slices a text file by tokenizer: use custom with a JSONL of prompts",
    "random-mm": "multimodal: the served models take text only",
    "random-rerank": "reranking: the server serves no pooling or rerank model",
}
_DATASET_FLAGS = "a flag of a dataset that is not offered ({})"
# vLLM's flags that mean nothing against this client, and why: given, they are an error that says so
REFUSED = {
    "--use-beam-search": "the server has no beam search",
    "--profile": "it drives vLLM's torch profiler endpoints (/start_profile), which this server does not serve",
    "--self-timed": "it replays the timestamps of the timed_trace dataset, which is not offered",
    "--plot-timeline": "not implemented (vLLM draws it with plotly); --save-detailed saves start_times, ttfts and itls",
    "--timeline-itl-thresholds": "it colours --plot-timeline, which is not implemented",
    "--plot-dataset-stats": "not implemented; --save-detailed saves input_lens and output_lens",
    "--chat-template-kwargs": "no dataset here renders a chat template on the client (openai-chat sends messages and "
    "the server renders them)",
    "--random-batch-size": "it batches embedding requests; the server serves no embeddings",
    "--no-reranker": "it is for reranker benchmarks; the server serves no reranker",
    "--sharegpt-output-len": _DATASET_FLAGS.format("sharegpt"),
    "--sonnet-input-len": _DATASET_FLAGS.format("sonnet"),
    "--sonnet-output-len": _DATASET_FLAGS.format("sonnet"),
    "--sonnet-prefix-len": _DATASET_FLAGS.format("sonnet"),
    "--blazedit-min-distance": _DATASET_FLAGS.format("blazedit, an hf dataset"),
    "--blazedit-max-distance": _DATASET_FLAGS.format("blazedit, an hf dataset"),
    "--hf-subset": _DATASET_FLAGS.format("hf"),
    "--hf-split": _DATASET_FLAGS.format("hf"),
    "--hf-name": _DATASET_FLAGS.format("hf"),
    "--hf-output-len": _DATASET_FLAGS.format("hf"),
    "--spec-bench-output-len": _DATASET_FLAGS.format("spec_bench"),
    "--spec-bench-category": _DATASET_FLAGS.format("spec_bench"),
    "--random-mm-base-items-per-request": _DATASET_FLAGS.format("random-mm"),
    "--random-mm-num-mm-items-range-ratio": _DATASET_FLAGS.format("random-mm"),
    "--random-mm-limit-mm-per-prompt": _DATASET_FLAGS.format("random-mm"),
    "--random-mm-bucket-config": _DATASET_FLAGS.format("random-mm"),
}
# vLLM's flags that are accepted with no effect here, and why
NO_EFFECT = {
    "--trust-remote-code": "--tokenizer reads a local tokenizer.json, which runs no code",
    "--no-stream": "the custom dataset's file is read whole, as vLLM does without streaming",
}


class _Refused(argparse.Action):
    """A vLLM flag that means nothing here: giving it stops the command with the reason."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        self.reason = kwargs.pop("reason")
        super().__init__(option_strings, dest, nargs="?", default=None, help=kwargs.get("help"))

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} (vllm bench serve's) is not supported: {self.reason}")


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags; their names and defaults are vLLM's where vLLM has them."""
    _server_args(p.add_argument_group("server"))
    _trace_args(p.add_argument_group("trace"))
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    for name in SAMPLING_FLAGS[1:]:
        kind = int if name == "top_k" else float
        sampling.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help="(default: the server's)")
    sampling.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    sampling.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="ask for N logprobs per output token (chat: logprobs with top_logprobs N) (default: none)",
    )
    _result_args(p.add_argument_group("results"))
    refused = p.add_argument_group("vllm bench serve's flags that mean nothing here (giving one is an error)")
    for flag, reason in REFUSED.items():
        refused.add_argument(flag, action=_Refused, reason=reason, help=f"not supported: {reason}")
    for flag, reason in NO_EFFECT.items():
        refused.add_argument(flag, action="store_true", help=f"accepted, no effect: {reason}")


def _server_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--base-url", default=None, help="the server's URL, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)"
    )
    g.add_argument("--host", default="127.0.0.1", help="the server's host without --base-url (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="the server's port without --base-url (default: 8000)")
    g.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="the API path (default: /v1/completions; /v1/chat/completions sends messages)",
    )
    g.add_argument(
        "--backend",
        default=None,
        help=f"the request shape: {', '.join(BACKENDS)} (vllm is the completions API, as openai) (default: "
        "openai-chat when the endpoint ends in chat/completions, else openai)",
    )
    g.add_argument(
        "--model",
        default=None,
        help="the model name sent when no --lora-modules are given (default: the first model the server lists)",
    )
    g.add_argument(
        "--served-model-name", default=None, help="the name sent instead of --model's (vLLM's) (default: --model)"
    )
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="[NAME=]KEY",
        help="a key sent as 'Authorization: Bearer KEY'; several spread requests over tenants",
    )
    g.add_argument(
        "--tenant-keys",
        default=None,
        metavar="FILE|LIST",
        help="tenants' keys, [NAME=]KEY, one a line in FILE or comma-separated (added to --api-key)",
    )
    g.add_argument("--header", nargs="*", default=None, metavar="KEY=VALUE", help="extra headers on every request")
    g.add_argument(
        "--request-id-prefix",
        default=f"bench-{uuid.uuid4().hex[:8]}-",
        help="each request's x-request-id is this and its index (default: bench-RANDOM-)",
    )
    g.add_argument("--insecure", action="store_true", help="do not verify the server's TLS certificate")
    g.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=0,
        help="send the first request until it succeeds, for at most this long, before the run (default: 0, no check)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="a local HF tokenizer directory (or tokenizer.json), e.g. from lora-server export-tokenizer: random "
        "prompts are cut to exactly their length in its tokens, and it counts output tokens a server does not "
        "report (default: none: the server's usage counts)",
    )
    g.add_argument(
        "--tokenizer-mode", default="auto", help="auto or hf, both the tokenizer.json as it is (default: auto)"
    )
    g.add_argument("--skip-tokenizer-init", action="store_true", help="use no tokenizer, even with --tokenizer")


def _trace_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--dataset-name",
        default="random",
        help="random: a prompt of random words per request; prefix_repetition: random prompts after one of a few "
        "shared prefixes; custom: the prompts of a JSONL file (--dataset-path); multi-turn: conversations with a "
        "system prompt per adapter, each turn carrying the previous ones (default: random)",
    )
    g.add_argument("--dataset-path", default=None, help='custom: a JSONL file, one {"prompt": ...} a line')
    g.add_argument("--num-prompts", type=int, default=1000, help="requests (multi-turn: conversations) (default: 1000)")
    g.add_argument("--input-len", type=int, default=None, help="sets --random-input-len (vLLM's) (default: unset)")
    g.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="sets --random-output-len, --custom-output-len and --prefix-repetition-output-len (default: unset)",
    )
    g.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="words per prompt (multi-turn: per user turn), one token each on Llama vocabularies, exactly so many "
        "tokens with --tokenizer (default: 1024)",
    )
    g.add_argument("--random-output-len", type=int, default=128, help="max_tokens per request (default: 128)")
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)] (default: 0, fixed)",
    )
    g.add_argument("--random-prefix-len", type=int, default=0, help="words shared by every prompt (default: 0)")
    g.add_argument("--custom-output-len", type=int, default=256, help="custom: max_tokens per request (default: 256)")
    g.add_argument(
        "--skip-chat-template",
        action="store_true",
        help="custom: send the prompts as they are (needed with a completions backend: no chat template is rendered "
        "on the client)",
    )
    g.add_argument(
        "--disable-shuffle", action="store_true", help="custom: the file's order (default: shuffled, as vLLM)"
    )
    g.add_argument(
        "--no-oversample",
        action="store_true",
        help="custom: fewer prompts than --num-prompts are sent once each (default: drawn again to fill up)",
    )
    for name, default, what in (
        ("prefix-len", 256, "words of each shared prefix"),
        ("suffix-len", 256, "words after the prefix"),
        ("num-prefixes", 10, "shared prefixes; each takes num-prompts / num-prefixes requests"),
        ("output-len", 128, "max_tokens per request"),
    ):
        g.add_argument(f"--prefix-repetition-{name}", type=int, default=default, help=f"{what} (default: {default})")
    g.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation (default: 3)")
    g.add_argument(
        "--system-prompt-len",
        type=int,
        default=64,
        help="multi-turn: words of each adapter's system prompt (default: 64)",
    )
    g.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME", help="adapter names to spread requests over"
    )
    g.add_argument(
        "--lora-assignment",
        choices=["random", "round-robin", "zipf"],
        default="random",
        help="how each request (conversation) gets its adapter: random (uniform), round-robin, or zipf (the i-th "
        "of --lora-modules with probability proportional to 1 / i ** --lora-zipf-alpha) (default: random, as vLLM)",
    )
    g.add_argument(
        "--lora-zipf-alpha",
        type=float,
        default=None,
        help="the Zipf exponent of --lora-assignment zipf (default: 1.0)",
    )
    g.add_argument(
        "--request-rate", type=float, default=math.inf, help="arrivals per second; inf sends all at once (default: inf)"
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="the gamma shape of the gaps between arrivals: 1 is a Poisson process, below 1 burstier, above 1 more "
        "even (default: 1)",
    )
    g.add_argument(
        "--ramp-up-strategy",
        choices=["linear", "exponential"],
        default=None,
        help="raise the rate from --ramp-up-start-rps to --ramp-up-end-rps over the run (instead of --request-rate)",
    )
    g.add_argument("--ramp-up-start-rps", type=int, default=None, help="the ramp's first rate (default: none)")
    g.add_argument("--ramp-up-end-rps", type=int, default=None, help="the ramp's last rate (default: none)")
    g.add_argument("--max-concurrency", type=int, default=None, help="the most requests in flight (default: no limit)")
    g.add_argument(
        "--probe-request-rate",
        type=float,
        default=0.0,
        help="send one-token probe requests at this rate beside the trace, outside --max-concurrency, and report "
        "their latency (default: 0, none)",
    )
    g.add_argument(
        "--num-warmups", type=int, default=0, help="requests of the first prompt sent before the run (default: 0)"
    )
    g.add_argument("--seed", type=int, default=0, help="the trace's random seed (default: 0)")
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to ignore EOS (always on with the random datasets, as in vLLM)",
    )


def _result_args(g: argparse._ArgumentGroup) -> None:
    known = ",".join((*METRICS, *CLIENT_QUEUE_METRICS))
    g.add_argument(
        "--percentile-metrics",
        default=known,
        help=f"metrics to report, of {known}; the client-queue ones need --max-concurrency (default: all)",
    )
    g.add_argument("--metric-percentiles", default="99", help="percentiles to report, e.g. 50,90,99 (default: 99)")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs in ms (ttft, tpot, e2el) for the goodput: requests per second meeting all",
    )
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--append-result", action="store_true", help="append the result JSON as a line to the file")
    g.add_argument("--save-detailed", action="store_true", help="with per-request lists (lengths, times, texts)")
    g.add_argument("--result-dir", default=None, help="where results go (default: the current directory)")
    g.add_argument(
        "--result-filename",
        default=None,
        help="the JSON's name (default: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)",
    )
    g.add_argument("--label", default=None, help="the result's label (default: the backend)")
    g.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="saved in the result JSON")
    g.add_argument(
        "--plot-rates",
        default=None,
        metavar="RATE[,RATE...]",
        help="run once per request rate and draw latency against throughput (needs matplotlib)",
    )
    g.add_argument("--plot-file", default=None, help="the PNG (default: RESULT_DIR/bench-serve.png)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def check_args(args: argparse.Namespace) -> None:
    """Combinations vLLM refuses, and what this client cannot do, as ValueError; maps --input-len / --output-len
    onto the datasets' own flags, as vLLM does, and --lora-assignment zipf onto zipf:ALPHA (the trace's value)."""
    if args.backend is not None and args.backend not in BACKENDS:
        raise ValueError(f"--backend {args.backend}: only the OpenAI APIs are spoken ({', '.join(BACKENDS)})")
    if args.dataset_name in OTHER_DATASETS:
        raise ValueError(f"--dataset-name {args.dataset_name} is not offered: {OTHER_DATASETS[args.dataset_name]}")
    if args.dataset_name not in DATASETS:
        raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}")
    if (args.dataset_path is None) == (args.dataset_name == "custom"):
        raise ValueError("--dataset-path goes with --dataset-name custom, and only with it")
    if args.tokenizer_mode not in ("auto", "hf"):
        raise ValueError("--tokenizer-mode: only auto and hf (a tokenizer.json as it is)")
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--num-prompts and --max-concurrency must be at least 1")
    if args.num_warmups < 0 or args.probe_request_rate < 0:
        raise ValueError("--num-warmups and --probe-request-rate must be at least 0")
    if args.ramp_up_strategy is not None:
        if math.isfinite(args.request_rate):
            raise ValueError("with --ramp-up-strategy the ramp sets the rate: leave out --request-rate")
        start, end = args.ramp_up_start_rps, args.ramp_up_end_rps
        if start is None or end is None:
            raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
        if not 0 < start <= end:
            raise ValueError("the ramp goes up from a start rate above 0 to an end rate at least as high")
        if args.plot_rates:
            raise ValueError("--plot-rates sets the rate of each run: it does not go with --ramp-up-strategy")
    if args.lora_zipf_alpha is not None:
        if not args.lora_assignment.startswith("zipf"):
            raise ValueError("--lora-zipf-alpha goes with --lora-assignment zipf")
        if args.lora_zipf_alpha < 0:
            raise ValueError("--lora-zipf-alpha must be at least 0 (0: uniform)")
    if args.lora_assignment == "zipf":  # the trace's assignment carries its exponent (serve_data.assign)
        args.lora_assignment = f"zipf:{1.0 if args.lora_zipf_alpha is None else float(args.lora_zipf_alpha)}"
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.custom_output_len = args.prefix_repetition_output_len = args.output_len
