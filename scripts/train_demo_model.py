#!/usr/bin/env python3
"""Train the built-in demo model shipped in ``vllm/demo_model``.

The model is a tiny ``LlamaForCausalLM`` (a few million parameters) trained
from scratch on the Python standard library's own ``.py`` sources, which exist
on every machine with Python installed, so the whole pipeline runs offline.

Steps:

1. collect the corpus deterministically and split off a held-out set
   (every file whose index in the sorted file list is divisible by 50);
2. train a byte-level BPE tokenizer with the ``tokenizers`` library and save
   it as a Hugging Face tokenizer (with a simple chat template);
3. train the model with AdamW and a cosine schedule driven by a wall-time
   budget (``--minutes``), checkpointing so the run can be resumed;
4. evaluate held-out perplexity with ``transformers``, write ``eval.json``,
   ``heldout_sample.txt`` and ``README.md`` next to the model.

Example::

    nohup python3 scripts/train_demo_model.py --minutes 40 > /tmp/demo_train.log 2>&1 &

Everything runs on one CPU thread (``--threads``).
"""

from __future__ import annotations

import os

# Keep the Rust tokenizer (rayon) on a single thread too; must be set before
# ``tokenizers`` is imported.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

# ---------------------------------------------------------------------------
# Constants describing the corpus and the evaluation protocol.  They are
# written into eval.json / README.md so that other programs can recompute the
# numbers.
# ---------------------------------------------------------------------------

# Directory names (any path component) that are skipped when walking stdlib.
SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "turtledemo",
        "__pycache__",
        "ensurepip",
        "encodings",  # mostly machine-generated codec tables
        "pydoc_data",  # one huge generated string literal
    }
)
# Directory names starting with these prefixes are skipped too
# (e.g. "config-3.11-x86_64-linux-gnu").
SKIP_DIR_PREFIXES = ("config-",)
MAX_FILE_BYTES = 400_000
HELDOUT_EVERY = 50
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]
BOS, EOS, UNK = SPECIAL_TOKENS
HELDOUT_SAMPLE_MAX_BYTES = 32_000
HELDOUT_SAMPLE_SEPARATOR = "\n\n"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

SAMPLE_PROMPTS = [
    "def __init__(self",
    "import os\nimport ",
    "class Error(Exception):\n",
    "    def __repr__(self):\n        return ",
    "for i in range(",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path) -> list[str]:
    """Sorted POSIX relative paths of the usable ``.py`` files under root."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if d not in SKIP_DIRS and not d.startswith(SKIP_DIR_PREFIXES)
        ]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = Path(dirpath) / name
            try:
                if full.stat().st_size > MAX_FILE_BYTES:
                    continue
                full.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            out.append(full.relative_to(root).as_posix())
    out.sort()
    return out


def read_text(root: Path, rel: str) -> str:
    return (root / rel).read_bytes().decode("utf-8")


def split_corpus(files: list[str], max_train_bytes: int, root: Path):
    """Held-out: sorted index % HELDOUT_EVERY == 0.  Training: the rest, in
    sorted order, until ``max_train_bytes`` of UTF-8 text have been taken."""
    heldout = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == 0]
    train: list[str] = []
    total = 0
    for i, f in enumerate(files):
        if i % HELDOUT_EVERY == 0:
            continue
        size = (root / f).stat().st_size
        if total + size > max_train_bytes:
            break
        train.append(f)
        total += size
    return train, heldout


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    # Like Llama tokenizers: encoding with special tokens prepends <s>.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, bos_id)],
            ),
        ]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    save_tokenizer(hf_tok, out_dir)
    return hf_tok


def save_tokenizer(hf_tok, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json
    hf_tok.save_pretrained(str(out_dir), save_jinja_files=False)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    changed = False
    if cfg.get("chat_template") != CHAT_TEMPLATE:
        cfg["chat_template"] = CHAT_TEMPLATE
        changed = True
    for key in ("is_local", "local_files_only"):  # loader artefacts, not settings
        if key in cfg:
            del cfg[key]
            changed = True
    if cfg.get("tokenizer_class") != "PreTrainedTokenizerFast":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        changed = True
    if changed:
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = out_dir / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()
    stm = out_dir / "special_tokens_map.json"
    if not stm.exists():
        stm.write_text(
            json.dumps({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}, indent=2) + "\n"
        )


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_documents(hf_tok, texts: list[str]) -> list[list[int]]:
    """Each document becomes [<s>] + tokens + [</s>]."""
    backend = hf_tok.backend_tokenizer
    encs = backend.encode_batch(texts, add_special_tokens=False)
    bos, eos = hf_tok.bos_token_id, hf_tok.eos_token_id
    return [[bos] + e.ids + [eos] for e in encs]


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def build_config(args, hf_tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=None,
        initializer_range=0.02,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        use_cache=True,
    )


def lr_at(step: int, progress: float, args) -> float:
    """Linear warmup over ``args.warmup_steps`` steps, then cosine decay from
    ``args.lr`` to ``args.lr * args.min_lr_ratio`` over the wall-time budget
    (``progress`` = training seconds so far / budget seconds)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    lo = args.lr * args.min_lr_ratio
    return lo + 0.5 * (args.lr - lo) * (1.0 + math.cos(math.pi * p))


def window_starts(n_tokens: int, ctx: int, shift: int) -> torch.Tensor:
    return torch.arange(shift, n_tokens - ctx + 1, ctx)


def bf16_supported() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False


@torch.no_grad()
def nll_of_windows(model, stream: torch.Tensor, ctx: int, max_windows: int | None = None):
    """Split ``stream`` into consecutive non-overlapping windows of ``ctx``
    tokens (the last one may be shorter; it is kept if it has >= 2 tokens),
    run each window independently (positions start at 0) and sum the
    next-token negative log-likelihood over all positions 1..len-1 of every
    window.  Returns (sum_nll, n_predicted, n_windows)."""
    model.eval()
    total = 0.0
    count = 0
    n_windows = 0
    for start in range(0, stream.numel(), ctx):
        w = stream[start : start + ctx]
        if w.numel() < 2:
            break
        logits = model(input_ids=w.unsqueeze(0)).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1)
        nll = -lp.gather(1, w[1:].unsqueeze(1)).squeeze(1)
        total += float(nll.double().sum())
        count += int(nll.numel())
        n_windows += 1
        if max_windows is not None and n_windows >= max_windows:
            break
    return total, count, n_windows


def save_checkpoint(ckpt_dir: Path, model, optim, state: dict) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / "state.pt.tmp"
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), **state}, tmp)
    os.replace(tmp, ckpt_dir / "state.pt")


def train(args, model, train_stream: torch.Tensor, heldout_stream: torch.Tensor, ckpt_dir: Path,
          resume_state: dict | None):
    ctx, bsz = args.context, args.batch_size
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    optim = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    step, epoch, batch_in_epoch, train_seconds = 0, 0, 0, 0.0
    if resume_state is not None:
        optim.load_state_dict(resume_state["optim"])
        step = resume_state["step"]
        epoch = resume_state["epoch"]
        batch_in_epoch = resume_state["batch_in_epoch"]
        train_seconds = resume_state["train_seconds"]
        log(f"resumed at step {step}, epoch {epoch}, {train_seconds / 60:.1f} min trained")

    budget = args.minutes * 60.0
    use_bf16 = {"on": True, "off": False, "auto": bf16_supported()}[args.bf16]
    log(f"bf16 autocast: {use_bf16}; budget {args.minutes} min; "
        f"{train_stream.numel()} training tokens; batch {bsz}x{ctx}")

    def epoch_order(e: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(args.seed * 1000 + e)
        shift = int(torch.randint(0, ctx, (1,), generator=g))
        starts = window_starts(train_stream.numel(), ctx, shift)
        return starts[torch.randperm(starts.numel(), generator=g)]

    order = epoch_order(epoch)
    last_ckpt = time.time()
    window_t0, window_tokens, loss_acc, loss_n = time.time(), 0, 0.0, 0
    tokens_seen = step * bsz * ctx
    model.train()
    while train_seconds < budget:
        t0 = time.time()
        if (batch_in_epoch + 1) * bsz > order.numel():
            epoch += 1
            batch_in_epoch = 0
            order = epoch_order(epoch)
            log(f"epoch {epoch} begins")
        idx = order[batch_in_epoch * bsz : (batch_in_epoch + 1) * bsz]
        x = torch.stack([train_stream[s : s + ctx] for s in idx.tolist()])
        lr = lr_at(step, train_seconds / budget, args)
        for group in optim.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            out = model(input_ids=x, labels=x)
        loss = out.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1
        batch_in_epoch += 1
        tokens_seen += x.numel()
        train_seconds += time.time() - t0
        loss_acc += float(loss.detach())
        loss_n += 1
        window_tokens += x.numel()
        if step % args.log_every == 0:
            dt = time.time() - window_t0
            log(f"step {step} epoch {epoch} loss {loss_acc / loss_n:.4f} lr {lr:.2e} "
                f"{window_tokens / dt:.0f} tok/s "
                f"trained {train_seconds / 60:.1f}/{args.minutes} min")
            window_t0, window_tokens, loss_acc, loss_n = time.time(), 0, 0.0, 0
        if time.time() - last_ckpt > args.ckpt_minutes * 60 or train_seconds >= budget:
            s, c, _ = nll_of_windows(model, heldout_stream, ctx, max_windows=32)
            model.train()
            log(f"step {step}: held-out (first 32 windows) loss {s / c:.4f} "
                f"ppl {math.exp(s / c):.2f}")
            state = {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                     "train_seconds": train_seconds, "args": vars(args)}
            save_checkpoint(ckpt_dir, model, optim, state)
            log(f"checkpoint saved to {ckpt_dir}")
            last_ckpt = time.time()
            window_t0, window_tokens, loss_acc, loss_n = time.time(), 0, 0.0, 0
    return {"steps": step, "epochs_completed": epoch, "train_seconds": train_seconds,
            "tokens_seen": tokens_seen, "bf16_autocast": use_bf16}


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=40.0,
                    help="wall-time budget of the training loop in minutes (default 40)")
    ap.add_argument("--out", default="vllm/demo_model", help="output model folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-dir", default=None,
                    help="checkpoint folder (default: <tmp>/vllm_demo_model_ckpt)")
    ap.add_argument("--resume", action="store_true",
                    help="resume from the checkpoint in --ckpt-dir if there is one")
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--intermediate-size", type=int, default=688)
    ap.add_argument("--num-layers", type=int, default=5)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--max-position-embeddings", type=int, default=1024)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--max-train-bytes", type=int, default=16_000_000,
                    help="cap on training corpus size (UTF-8 bytes)")
    ap.add_argument("--bf16", choices=["auto", "on", "off"], default="auto",
                    help="bf16 autocast for training (weights stay float32)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    out_dir = Path(args.out)
    ckpt_dir = Path(args.ckpt_dir or Path(tempfile.gettempdir()) / "vllm_demo_model_ckpt")
    command = "python3 scripts/train_demo_model.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    wall_t0 = time.time()

    # 1. corpus --------------------------------------------------------------
    root = stdlib_root()
    files = list_corpus_files(root)
    train_files, heldout_files = split_corpus(files, args.max_train_bytes, root)
    train_texts = [read_text(root, f) for f in train_files]
    heldout_texts = [read_text(root, f) for f in heldout_files]
    train_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    heldout_bytes = sum(len(t.encode("utf-8")) for t in heldout_texts)
    log(f"stdlib {root}: {len(files)} files; train {len(train_files)} files "
        f"({train_bytes} bytes); held-out {len(heldout_files)} files ({heldout_bytes} bytes)")

    # 2. tokenizer -------------------------------------------------------------
    resume_state = None
    if args.resume and (ckpt_dir / "state.pt").exists():
        hf_tok = load_tokenizer(ckpt_dir / "tokenizer")
        resume_state = torch.load(ckpt_dir / "state.pt", map_location="cpu", weights_only=False)
        log(f"loaded checkpoint from {ckpt_dir}")
    else:
        t = time.time()
        hf_tok = train_tokenizer(train_texts, args.vocab_size, ckpt_dir / "tokenizer")
        log(f"tokenizer trained in {time.time() - t:.1f}s: vocab {len(hf_tok)}")
        hf_tok = load_tokenizer(ckpt_dir / "tokenizer")

    t = time.time()
    train_docs = encode_documents(hf_tok, train_texts)
    heldout_docs = encode_documents(hf_tok, heldout_texts)
    train_stream = torch.tensor([i for d in train_docs for i in d], dtype=torch.long)
    heldout_stream = torch.tensor([i for d in heldout_docs for i in d], dtype=torch.long)
    log(f"tokenized in {time.time() - t:.1f}s: train {train_stream.numel()} tokens "
        f"({train_bytes / train_stream.numel():.2f} bytes/token), "
        f"held-out {heldout_stream.numel()} tokens")

    # 3. model + training -----------------------------------------------------
    config = build_config(args, hf_tok)
    model = LlamaForCausalLM(config)
    if resume_state is not None:
        model.load_state_dict(resume_state["model"])
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters (tied embeddings)")
    train_info = train(args, model, train_stream, heldout_stream, ckpt_dir, resume_state)
    log(f"training done: {train_info}")

    # 4. save -----------------------------------------------------------------
    model = model.float().eval()
    model.generation_config = GenerationConfig(
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.eos_token_id,
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    save_tokenizer(hf_tok, out_dir)
    # Older/other readers look for these keys; transformers 5 writes "dtype"
    # and "rope_parameters" instead.
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    cfg.setdefault("rope_theta", 10000.0)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    # 5. evaluate with a fresh transformers load of the saved folder ----------
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    tok = load_tokenizer(out_dir)
    ctx = args.context
    t = time.time()
    s, c, nw = nll_of_windows(loaded, heldout_stream, ctx)
    heldout_ppl = math.exp(s / c)
    log(f"held-out: {c} predicted tokens in {nw} windows, loss {s / c:.4f}, "
        f"ppl {heldout_ppl:.3f} ({time.time() - t:.1f}s)")

    sample_text = build_heldout_sample(heldout_texts)
    (out_dir / "heldout_sample.txt").write_bytes(sample_text.encode("utf-8"))
    sample_ids = torch.tensor(tok(sample_text)["input_ids"], dtype=torch.long)
    ss, sc, snw = nll_of_windows(loaded, sample_ids, ctx)
    sample_ppl = math.exp(ss / sc)
    log(f"heldout_sample: {sample_ids.numel()} tokens, {snw} windows, ppl {sample_ppl:.3f}")

    samples = []
    for prompt in SAMPLE_PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            gen = loaded.generate(**enc, max_new_tokens=48, do_sample=False)
        text = tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        samples.append({"prompt": prompt, "completion": text})
        log(f"sample {prompt!r} -> {text!r}")

    size_bytes = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    eval_info = {
        "perplexity": heldout_ppl,
        "mean_nll": s / c,
        "num_tokens_evaluated": c,
        "num_windows": nw,
        "num_heldout_tokens": int(heldout_stream.numel()),
        "context_length": ctx,
        "heldout_rule": (
            f"Python {platform.python_version()} stdlib (sysconfig.get_paths()['stdlib']); "
            f".py files, skipping directories {sorted(SKIP_DIRS)} and names starting with "
            f"{list(SKIP_DIR_PREFIXES)}, files > {MAX_FILE_BYTES} bytes and files that are not "
            f"valid UTF-8; relative POSIX paths sorted; held-out = sorted index % "
            f"{HELDOUT_EVERY} == 0"
        ),
        "heldout_files": heldout_files,
        "windowing": (
            "each held-out file (in the listed order) -> [<s>] + tokenizer.encode(text, "
            "add_special_tokens=False) + [</s>]; concatenated into one stream; split into "
            "consecutive non-overlapping windows of context_length tokens (last window may be "
            "shorter, kept if >= 2 tokens); each window scored independently from position 0; "
            "NLL summed over positions 1..len-1 of every window; perplexity = "
            "exp(sum NLL / num_tokens_evaluated)"
        ),
        "heldout_sample_file": "heldout_sample.txt",
        "heldout_sample_perplexity": sample_ppl,
        "heldout_sample_mean_nll": ss / sc,
        "heldout_sample_num_tokens": int(sample_ids.numel()),
        "heldout_sample_num_tokens_evaluated": sc,
        "heldout_sample_num_windows": snw,
        "heldout_sample_windowing": (
            "ids = tokenizer(text)['input_ids'] (add_special_tokens=True: <s> prepended, no "
            "</s>); split into consecutive non-overlapping windows of context_length tokens "
            "(last window may be shorter, kept if >= 2 tokens); each window scored "
            "independently from position 0 in float32; NLL summed over positions 1..len-1 of "
            "every window; perplexity = exp(sum NLL / heldout_sample_num_tokens_evaluated)"
        ),
        "dtype": "float32",
        "evaluated_with": f"transformers {__import__('transformers').__version__}, "
                          f"torch {torch.__version__}",
        "num_parameters": n_params,
        "vocab_size": len(tok),
        "train_files": len(train_files),
        "train_bytes": train_bytes,
        "train_tokens": int(train_stream.numel()),
        "heldout_bytes": heldout_bytes,
        "training": {**train_info, "train_minutes": train_info["train_seconds"] / 60},
        "python_version": platform.python_version(),
        "command": command,
        "seed": args.seed,
        "samples": samples,
    }
    (out_dir / "eval.json").write_text(json.dumps(eval_info, indent=2) + "\n")
    (out_dir / "README.md").write_text(render_readme(args, eval_info, config, command,
                                                     time.time() - wall_t0))
    size_bytes = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    log(f"wrote {out_dir} ({size_bytes / 1e6:.2f} MB)")


def build_heldout_sample(heldout_texts: list[str]) -> str:
    """Held-out files joined with a blank line, cut at the last newline that
    keeps the UTF-8 size <= HELDOUT_SAMPLE_MAX_BYTES."""
    text = HELDOUT_SAMPLE_SEPARATOR.join(heldout_texts)
    raw = text.encode("utf-8")[:HELDOUT_SAMPLE_MAX_BYTES]
    raw = raw[: raw.rfind(b"\n") + 1]
    return raw.decode("utf-8")


def render_readme(args, ev: dict, config, command: str, total_seconds: float) -> str:
    tr = ev["training"]
    samples = "\n\n".join(
        f"Prompt `{s['prompt']!r}`:\n\n```python\n{s['prompt']}{s['completion']}\n```"
        for s in ev["samples"]
    )
    heads = (f"{config.num_attention_heads} / {config.num_key_value_heads} (GQA, head dim "
             f"{config.hidden_size // config.num_attention_heads})")
    positions = f"{config.max_position_embeddings} (trained on {args.context}-token windows)"
    return f"""# Demo model: tiny Llama trained on the Python standard library

This folder is a normal Hugging Face model folder (`LlamaForCausalLM`,
float32 safetensors, fast byte-level BPE tokenizer with a chat template).
It is trained from scratch by `scripts/train_demo_model.py` on the `.py`
sources of the Python standard library, so it can be rebuilt offline on any
machine, and it is small enough ({ev['num_parameters']:,} parameters) to run
in tests on a CPU.  It writes Python-looking code; it knows nothing else.
The chat template exists only so that chat code paths can be exercised.

## Model

| | |
|---|---|
| architecture | `LlamaForCausalLM` |
| parameters | {ev['num_parameters']:,} (tied input/output embeddings) |
| hidden size / intermediate | {config.hidden_size} / {config.intermediate_size} |
| layers | {config.num_hidden_layers} |
| attention heads / KV heads | {heads} |
| max position embeddings | {positions} |
| RoPE theta | 10000 |
| vocab | {ev['vocab_size']} (byte-level BPE; `<s>`=0 bos, `</s>`=1 eos, `<unk>`=2) |
| dtype | float32 |

The tokenizer prepends `<s>` when encoding with special tokens (like Llama
tokenizers) and does not append `</s>`.  The chat template renders
`<s>` followed by one `role: content` line per message and, with
`add_generation_prompt=True`, a final `assistant:`.

## Training

Command (one CPU thread):

```
{command}
```

* Corpus: Python {ev['python_version']} standard library `.py` files
  ({ev['train_files']} training files, {ev['train_bytes']:,} bytes,
  {ev['train_tokens']:,} tokens); each file is encoded as
  `<s>` + tokens + `</s>` and all files are concatenated.
* Tokenizer: `tokenizers` byte-level BPE trained on the training files,
  vocab size {ev['vocab_size']}, `min_frequency=2`.
* Optimiser: AdamW (betas 0.9/0.95, weight decay {args.weight_decay}, no
  decay on norms), peak LR {args.lr}, {args.warmup_steps} warmup steps, then
  cosine decay to {args.lr * args.min_lr_ratio:.1e} over the wall-time budget;
  gradient clipping {args.grad_clip}; batches of {args.batch_size} x {args.context}
  tokens (shuffled non-overlapping windows, re-shuffled and re-offset each epoch);
  bf16 autocast: {tr['bf16_autocast']} (weights kept in float32); seed {args.seed}.
* Training: {tr['steps']} steps, {tr['tokens_seen']:,} tokens seen
  ({tr['tokens_seen'] / max(ev['train_tokens'], 1):.2f} epochs),
  {tr['train_minutes']:.1f} minutes of training wall time
  ({total_seconds / 60:.1f} minutes for the whole script).

## Held-out evaluation

* Held-out perplexity: **{ev['perplexity']:.3f}** (mean NLL {ev['mean_nll']:.4f} nats,
  {ev['num_tokens_evaluated']:,} tokens evaluated in {ev['num_windows']} windows).
* `heldout_sample.txt` perplexity: **{ev['heldout_sample_perplexity']:.3f}**
  ({ev['heldout_sample_num_tokens_evaluated']:,} tokens evaluated in
  {ev['heldout_sample_num_windows']} windows).

Both were computed with `transformers` ({ev['evaluated_with']}) on the saved
folder in float32.

### Protocol (to recompute)

1. File selection: {ev['heldout_rule']}.  The exact list is in `eval.json`
   (`heldout_files`, {len(ev['heldout_files'])} files).
2. Held-out perplexity: {ev['windowing']}.  Context length is {ev['context_length']}.
3. `heldout_sample.txt` ({HELDOUT_SAMPLE_MAX_BYTES // 1000} KB at most): the held-out files
   joined with a blank line (`"\\n\\n"`), cut after the last newline within the first
   {HELDOUT_SAMPLE_MAX_BYTES} UTF-8 bytes.  Its perplexity: {ev['heldout_sample_windowing']}.

In Python, for the sample:

```python
ids = tok(open("heldout_sample.txt", encoding="utf-8").read())["input_ids"]
nll, n = 0.0, 0
for s in range(0, len(ids), {ev['context_length']}):
    w = torch.tensor(ids[s:s + {ev['context_length']}])
    if len(w) < 2:
        break
    logp = model(w[None]).logits[0, :-1].float().log_softmax(-1)
    nll -= logp.gather(1, w[1:, None]).sum().item()
    n += len(w) - 1
ppl = math.exp(nll / n)
```

## Greedy samples (48 new tokens)

Greedy decoding of a model this small soon repeats itself.  The tokenizer
merges a leading space into the following word (`" os"`), so a prompt that
ends in a space (`"import "`) is slightly out of distribution.

{samples}
"""


if __name__ == "__main__":
    main()
