"""The tiny model rpk builds itself, so that tests and demos never download anything.

`build_tiny_model` trains a byte-level BPE tokenizer on the arithmetic task's text, makes a
small Qwen2 causal LM and warms it up with a short supervised phase on reference
solutions: RL then starts from a policy that is right on part of the prompts (mostly the
short ones) and can be sharpened. The result is an ordinary Hugging Face model directory
that vLLM and transformers both load, cached under a hash of the spec and of
`CODE_VERSION`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rpk.core.errors import UserError
from rpk.tasks.arith import make_problem, solution_text
from rpk.tasks.specs import TinySpec

# Bump whenever a change here alters what a build produces for the same spec, so that
# stale cached models are not reused.
CODE_VERSION = 3

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)  # ids 0, 1, 2

# BPE only merges inside words (digits and punctuation are split off first), so a few
# hundred problems already yield every merge the task's text has.
_TOKENIZER_PROBLEMS = 300
# transformers' Qwen2Tokenizer pre-tokenizer (see build_tokenizer for why it is copied).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_BATCH_WINDOW = 1000

# Qwen-style ChatML without the default system prompt (it would only lengthen prompts).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# One warm-up example: token ids and, per id, 1 where the loss is taken (the tokens the
# model is to write) and 0 elsewhere (the prompt, tool observations).
Example = tuple[list[int], list[int]]


@dataclass(frozen=True, slots=True)
class Recipe:
    """What a tiny model is built for: the text its tokenizer learns from, the warm-up
    examples, and the version of that code (bumped when a build's output changes)."""

    task: str
    code_version: int
    corpus: Callable[[TinySpec], list[str]]
    examples: Callable[[Any, TinySpec], list[Example]]
    # The build's own figures (model, tokenizer, spec -> name: value), written into
    # rpk_tiny.json; None: the warm-up loss is the only one.
    evaluate: Callable[[Any, Any, TinySpec], dict[str, float]] | None = None
    # Torch threads for the build. A width-64 model's matrices are too small to pay for
    # a second thread's synchronisation: on a busy 2-core machine one thread ran its
    # steps 20-50x faster than two.
    threads: int = 2


def cache_key(spec: TinySpec, recipe: Recipe | None = None) -> str:
    """What names a build in the cache: the spec, the recipe's task and its code
    version. The arith recipe's key leaves the task out, as it did before there were
    other recipes, so that existing caches stay valid."""
    recipe = recipe or ARITH
    key: dict[str, Any] = {"code_version": _version(recipe), "spec": dataclasses.asdict(spec)}
    if recipe is not ARITH:
        key["task"] = recipe.task
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _version(recipe: Recipe) -> int:
    # Arith's version is this module's CODE_VERSION, read when used (not when ARITH was
    # made), so that bumping it is the one edit that invalidates arith builds.
    return CODE_VERSION if recipe is ARITH else recipe.code_version


# --------------------------------------------------------------------------- tokenizer


def _corpus(spec: TinySpec) -> list[str]:
    rng = random.Random(f"tokenizer-{spec.seed}")
    texts = ["system", "user", "assistant"]
    for _ in range(_TOKENIZER_PROBLEMS):
        p = make_problem(rng, spec.task)
        texts += [p.question, solution_text(p)]
    return texts


def build_tokenizer(spec: TinySpec, corpus: Sequence[str] | None = None) -> Any:
    """A byte-level BPE trained on task text (`corpus`, the arith task's by default), as
    a transformers fast tokenizer.

    Digits are split before BPE so that every digit is its own token: merged digit
    chunks would make column arithmetic unlearnable for a model this small. Merges are
    learnt with punctuation and spaces split from letters too, so labels such as `a` in
    `+a7` or `D` in `Answer: D5` stay tokens of their own."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            # No merge of a space with what follows: `ĠD` would make the answer's first
            # label (`Answer: D5C2...`) a token other than the label `D` it must match.
            pre_tokenizers.Split(" ", behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes, so any text (a model's garbage included) round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec) if corpus is None else corpus, trainer=trainer)
    # transformers loads any model_type=qwen2 tokenizer as Qwen2Tokenizer, which rebuilds
    # Qwen's own normalizer and pre-tokenizer around the saved vocabulary and merges (so
    # does vLLM, through AutoTokenizer). Ship exactly that pipeline so the tokenizer used
    # here for the warm-up is the one everybody loads. It splits digits one by one too,
    # and the merges learnt above all sit inside words, where the two splitters agree,
    # so task text tokenises the same either way.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def _write_tokenizer(tokenizer: Any, out: pathlib.Path, spec: TinySpec) -> None:
    # Written by hand rather than with save_pretrained: the template must sit in
    # tokenizer_config.json (not a side file), and sorted keys keep the bytes stable.
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tokenizer.convert_tokens_to_ids(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- model + warm-up


def _maybe_slip(solution: str, rate: float, rng: random.Random) -> str:
    """With probability `rate`, change one digit of the final answer.

    A model warmed up on clean solutions is sharp: its errors are systematic and RL on
    a laptop budget barely moves them. Slips taught as a coin flip at the answer are
    errors the policy makes *by sampling*, which is what GRPO is quick to fix; so the
    default run shows RL working within minutes, from a reward far from perfect."""
    if rng.random() >= rate:
        return solution
    head, _, answer = solution.rpartition("Answer: ")
    pos = rng.choice([i for i, ch in enumerate(answer) if ch.isdigit()])
    wrong = str((int(answer[pos]) + rng.randint(1, 9)) % 10)
    return f"{head}Answer: {answer[:pos]}{wrong}{answer[pos + 1:]}"


def _habit(solution: str, digits: int, spec: TinySpec, rng: random.Random) -> str:
    """With probability `spec.sft_habit`, on the digit counts of `spec.sft_habit_digits`,
    end the answer one too high (units digit + 1, mod 10).

    Slips are spread over positions and digits, so greedy decoding still writes the
    right answer and only sampled accuracy has room to rise. A habit is one consistent
    wrong answer taught more often than the right one: greedy writes it, sampling still
    finds the right one often, and only the reward can move greedy over, as RL does for
    a base model's systematic mistakes."""
    lo, hi = spec.sft_habit_digits
    if not lo <= digits <= hi or rng.random() >= spec.sft_habit:
        return solution
    units = int(solution[-1])
    return f"{solution[:-1]}{(units + 1) % 10}"


def _encode_examples(tokenizer: Any, spec: TinySpec) -> list[Example]:
    """(prompt + response ids, loss mask) per warm-up problem, rendered exactly as the
    RL loop will render prompts; the loss is on the response."""
    rng = random.Random(f"sft-{spec.seed}")
    task = spec.task if spec.sft_alpha is None else dataclasses.replace(spec.task, alpha=spec.sft_alpha)
    problems = [make_problem(rng, task) for _ in range(spec.sft_problems)]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.question}], tokenize=False, add_generation_prompt=True
        )
        for p in problems
    ]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    slips = random.Random(f"slip-{spec.seed}")
    habits = random.Random(f"habit-{spec.seed}")
    solutions = [
        _habit(_maybe_slip(solution_text(p), spec.sft_slip, slips), p.digits, spec, habits)
        for p in problems
    ]
    response_ids = tokenizer(solutions, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    examples = [
        (list(p) + list(r) + [eos], [0] * len(p) + [1] * (len(r) + 1))
        for p, r in zip(prompt_ids, response_ids)
    ]
    check_fits(examples, spec)
    return examples


def check_fits(examples: Sequence[Example], spec: TinySpec) -> None:
    longest = max(len(ids) for ids, _ in examples)
    if longest > spec.max_position_embeddings:
        raise ValueError(
            f"max_position_embeddings ({spec.max_position_embeddings}) is shorter than the "
            f"longest prompt + solution ({longest} tokens); raise it or lower task.max_digits"
        )


def _batches(
    examples: list[Example], spec: TinySpec, rng: random.Random
) -> Iterator[list[Example]]:
    """Endless batches of similar lengths within the token budget: the lengths are
    long-tailed, and a random batch would be mostly padding behind its longest member.
    Each epoch shuffles, sorts within windows of `_BATCH_WINDOW` examples and packs
    each window greedily, so batches stay random yet length-homogeneous."""
    order = list(range(len(examples)))
    while True:
        rng.shuffle(order)
        chunks: list[list[int]] = []
        for start in range(0, len(order), _BATCH_WINDOW):
            window = sorted(
                order[start : start + _BATCH_WINDOW], key=lambda i: len(examples[i][0])
            )
            batch: list[int] = []
            for i in window:  # ascending length: the newcomer sets the padded width
                if batch and len(examples[i][0]) * (len(batch) + 1) > spec.sft_batch_tokens:
                    chunks.append(batch)
                    batch = []
                batch.append(i)
            chunks.append(batch)
        rng.shuffle(chunks)
        for chunk in chunks:
            yield [examples[i] for i in chunk]


def _collate(batch: list[Example], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, loss_mask) in enumerate(batch):
        tensor = torch.tensor(ids)
        input_ids[row, : len(ids)] = tensor
        mask[row, : len(ids)] = 1
        # Loss on what the model writes only: the prompt and observations are given.
        labels[row, : len(ids)] = torch.where(torch.tensor(loss_mask, dtype=torch.bool), tensor, -100)
    return input_ids, mask, labels


def _make_model(spec: TinySpec, tokenizer: Any) -> Any:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.eos_token_id
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    return model


def _warm_up(
    model: Any, tokenizer: Any, spec: TinySpec, recipe: Recipe, log: Callable[[str], None]
) -> float:
    """Supervised next-token training on reference solutions; returns the mean loss of
    the last log window."""
    import torch

    examples = recipe.examples(tokenizer, spec)
    batches = _batches(examples, spec, random.Random(f"batches-{spec.seed}"))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.sft_lr, betas=(0.9, 0.98), weight_decay=0.0
    )
    warmup = max(1, spec.sft_steps // 20)

    def lr_factor(step: int) -> float:
        # Linear warm-up, then cosine down to a tenth of the peak.
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, spec.sft_steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    log_every = max(1, spec.sft_steps // 10)
    # One batch's loss swings with its lengths and kinds: the log and the result are the
    # mean over the steps since the last log line.
    window: list[float] = []
    mean = float("nan")
    started = time.monotonic()
    for step in range(spec.sft_steps):
        input_ids, mask, labels = _collate(next(batches), tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        window.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == spec.sft_steps:
            mean = sum(window) / len(window)
            log(
                f"tiny: warm-up step {step + 1}/{spec.sft_steps} loss {mean:.4f} "
                f"(mean of {len(window)} steps, {time.monotonic() - started:.0f}s)"
            )
            window = []
    model.eval()
    return mean


@contextlib.contextmanager
def _build_threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_into(
    out: pathlib.Path, spec: TinySpec, recipe: Recipe, log: Callable[[str], None]
) -> None:
    """Build the model of `spec` and `recipe` into the directory `out`."""
    with _build_threads(recipe.threads):
        _build_into(out, spec, recipe, log)


def _build_into(
    out: pathlib.Path, spec: TinySpec, recipe: Recipe, log: Callable[[str], None]
) -> None:
    import torch

    started = time.monotonic()
    tokenizer = build_tokenizer(spec, recipe.corpus(spec))
    _write_tokenizer(tokenizer, out, spec)
    torch.manual_seed(spec.seed)
    model = _make_model(spec, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"tiny: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    loss = _warm_up(model, tokenizer, spec, recipe, log)
    model.save_pretrained(out, safe_serialization=True)
    figures = recipe.evaluate(model, tokenizer, spec) if recipe.evaluate is not None else {}
    if figures:
        log(f"tiny: {recipe.task} " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    info = {
        "spec": dataclasses.asdict(spec),
        "code_version": _version(recipe),
        "parameters": n_params,
        "final_sft_loss": loss,
        "build_seconds": round(time.monotonic() - started, 1),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **({"eval": figures} if figures else {}),
    }
    (out / "rpk_tiny.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def model_dir(spec: TinySpec, cache_root: pathlib.Path, recipe: Recipe | None = None) -> pathlib.Path:
    """Where the build of `spec` and `recipe` is cached (whether or not it is built yet)."""
    return pathlib.Path(cache_root) / f"tiny-{cache_key(spec, recipe)}"


def build_tiny_model(
    spec: TinySpec,
    cache_root: pathlib.Path,
    log: Callable[[str], None] = print,
    recipe: Recipe | None = None,
) -> pathlib.Path:
    """Return the model directory for `spec` and `recipe` (the arith task's by default),
    building it on a cache miss, in this thread (`rpk.tasks.tiny_build` builds in a
    process that a signal can stop).

    The build happens in a temporary sibling directory that is renamed into place only
    when complete, so a crashed or concurrent build never leaves a directory that looks
    done; of two concurrent builds of one spec, the first rename wins."""
    recipe = recipe or ARITH
    target, tmp = start_build(spec, cache_root, recipe, log)
    if tmp is None:
        return target
    started = time.monotonic()
    try:
        build_into(tmp, spec, recipe, log)
        install(tmp, target, log)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"tiny: built {target} in {time.monotonic() - started:.1f}s")
    return target


def start_build(
    spec: TinySpec, cache_root: pathlib.Path, recipe: Recipe, log: Callable[[str], None]
) -> tuple[pathlib.Path, pathlib.Path | None]:
    """(the cached model's directory, the empty temporary directory to build it in; None
    when the cache holds it already)."""
    cache_root = pathlib.Path(cache_root)
    target = model_dir(spec, cache_root, recipe)
    if target.is_dir():
        log(f"tiny: cache hit {target}")
        return target, None
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a dangling or looping link, a read-only disk: say which path
        raise UserError(f"model.cache_dir={str(cache_root)!r}: cannot make it ({e.strerror})") from None
    log(f"tiny: building {target}")
    return target, pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=cache_root))


def install(tmp: pathlib.Path, target: pathlib.Path, log: Callable[[str], None]) -> None:
    """Rename the finished build `tmp` into place as `target`, unless another build of
    it got there first."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
        log(f"tiny: another build of {target.name} finished first; using it")


ARITH = Recipe("arith", CODE_VERSION, _corpus, _encode_examples)
