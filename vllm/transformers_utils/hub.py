"""Models from the Hugging Face Hub: a repo id (`ORG/NAME`) becomes a snapshot folder of the
standard Hub cache, downloaded by huggingface_hub (`snapshot_download`; no downloader here).

Two steps, so that resolving a config (`vllm config`, `ModelConfig`) never fetches weights:
 1. `resolve_model` (config resolution): the revision is resolved to a commit
    (`HfApi.resolve_revision`: one metadata request for a branch or tag, none for a full
    commit sha or with HF_HUB_OFFLINE=1), then config.json, generation_config.json, the
    tokenizer and chat-template files and the weight index are fetched into
    `<cache>/models--ORG--NAME/snapshots/<commit>/`, and the weight files are chosen from
    the repo's file list (`weight_file_names`: safetensors, else PyTorch *.bin);
 2. `download_weights` (the model loader, unless load_format="dummy"): those weight files,
    at the same commit.
A complete cached snapshot is read without any request for its files: huggingface_hub
serves a commit's files from the cache and keeps the commit's file list on disk
(`trees/<commit>.json`). So a second start makes one metadata request for a branch (to see
whether it moved), and none for a commit sha or offline; when the Hub cannot be reached the
cached commit of the branch is used (huggingface_hub warns).

The environment is huggingface_hub's own: HF_TOKEN (private and gated repos), HF_HUB_OFFLINE
(cache only), HF_HOME / HF_HUB_CACHE (where the cache is; `download_dir` overrides it),
HF_ENDPOINT, HF_HUB_DISABLE_PROGRESS_BARS. Every failure is a one-line ValueError naming the
repo and what to do. Nothing heavy is imported until a repo id is resolved.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

SAFE_INDEX_NAME = "model.safetensors.index.json"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
# What the engine reads besides the weights: the config, default sampling parameters, the
# tokenizer (fast, sentencepiece or BPE vocab + merges) and chat templates.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "additional_chat_templates/*")
# *.bin files of training runs that are not model weights.
_NOT_WEIGHTS = re.compile(r"^(training_args|optimizer|scheduler|scaler|rng_state.*)\.bin$")
_REPO_PART = re.compile(r"^\w(?:[\w.-]{0,94}\w)?$")


@dataclass(frozen=True)
class HubSnapshot:
    """A model repo resolved to one commit of the local Hub cache."""

    repo_id: str
    revision: str | None
    """What was asked for (a branch, tag or commit; None: the default branch)."""
    commit: str
    """The commit sha it resolved to."""
    path: str
    """`<cache>/models--ORG--NAME/snapshots/<commit>`: the folder the engine reads."""
    cache_dir: str | None
    """The cache given as download_dir (None: huggingface_hub's HF_HUB_CACHE)."""
    weight_files: tuple[str, ...] = ()
    """The weight files the loader reads, relative to `path` (empty for a tokenizer)."""

    @property
    def revision_name(self) -> str:
        return self.revision or "main"

    def describe(self) -> str:
        """`ORG/NAME@main (commit 0123abc...)`."""
        return f"{self.repo_id}@{self.revision_name} (commit {self.commit})"


def is_repo_id(name: str) -> bool:
    """Whether a model name that is not a local folder is taken as a Hub repo id: `NAME` or
    `ORG/NAME` in the Hub's characters, and nothing that looks like a path (it starts with
    '/', '.' or '~', has a backslash or more than one '/', exists on disk as a file, or its
    first part is a local folder), so that a mistyped local path is reported as one."""
    if not isinstance(name, str) or not name or name.startswith(("/", ".", "~")) or "\\" in name:
        return False
    parts = name.split("/")
    if len(parts) > 2 or not all(_REPO_PART.match(p) for p in parts):
        return False
    if "--" in name or ".." in name or name.endswith(".git"):
        return False
    return not os.path.exists(name) and not (len(parts) == 2 and os.path.isdir(parts[0]))


def weight_file_names(names: list[str], read_index: Callable[[str], Any]) -> list[str]:
    """The weight files of a checkpoint, from its top-level file names: the shards the
    safetensors index lists, else every *.safetensors (but consolidated*.safetensors, the
    Mistral-format copy, when others exist); only without any safetensors, the same for
    PyTorch *.bin (pytorch_model.bin.index.json, else every *.bin but training state).
    `read_index(name)` returns an index file's JSON (None when it cannot be read: then every
    file of that format is taken). Empty when there are no weights."""
    top = sorted(n for n in names if "/" not in n)
    for index, suffix in ((SAFE_INDEX_NAME, ".safetensors"), (BIN_INDEX_NAME, ".bin")):
        files = [n for n in top if n.endswith(suffix)]
        if suffix == ".bin":
            files = [n for n in files if not _NOT_WEIGHTS.match(n)]
        if index in top:
            data = read_index(index)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if isinstance(weight_map, dict) and weight_map:
                return sorted(set(map(str, weight_map.values())))
        if files:
            plain = [n for n in files if not n.startswith("consolidated")]
            return plain or files
    return []


def resolve_model(repo_id: str, revision: str | None = None, download_dir: str | None = None,
                  trust_remote_code: bool = False) -> HubSnapshot:
    """Resolve `repo_id` at `revision` and fetch what config resolution and the tokenizer read
    (not the weights: `download_weights`). Raises ValueError (one line) when the repo, the
    revision or the weights are missing, access is refused, or the Hub cannot be reached and
    the cache lacks the files."""
    patterns = [*CONFIG_FILES, *TOKENIZER_FILES, SAFE_INDEX_NAME, BIN_INDEX_NAME]
    if trust_remote_code:
        patterns.append("*.py")  # the repo's own config/tokenizer classes
    snap, listing, listed = _fetch(repo_id, revision, download_dir, patterns)
    if not os.path.isfile(os.path.join(snap.path, "config.json")):
        raise ValueError(f"Hugging Face Hub model {snap.describe()} has no config.json: it is not "
                         "a Transformers model repo")
    weights = weight_file_names(listing, lambda name: _read_json(os.path.join(snap.path, name)))
    if not weights and not listed:  # a cached snapshot without its file list: incomplete
        from huggingface_hub import constants

        raise ValueError(_not_cached(repo_id, revision, snap.cache_dir,
                                     constants.is_offline_mode(),
                                     "the cached snapshot holds no weight files"))
    if not weights:
        raise ValueError(
            f"Hugging Face Hub model {snap.describe()} has no supported weights: no *.safetensors "
            f"and no PyTorch *.bin files (its files: {_sample(listing)})")
    logger.info("Hugging Face Hub model %s: revision %s is commit %s (snapshot %s, %d weight "
                "file%s)", repo_id, snap.revision_name, snap.commit, snap.path, len(weights),
                "" if len(weights) == 1 else "s")
    return HubSnapshot(snap.repo_id, snap.revision, snap.commit, snap.path, snap.cache_dir,
                       tuple(weights))


def resolve_tokenizer(repo_id: str, revision: str | None = None,
                      download_dir: str | None = None) -> HubSnapshot:
    """A tokenizer-only repo (or another revision of the model's): config.json and the
    tokenizer and chat-template files."""
    snap, _, _ = _fetch(repo_id, revision, download_dir, ["config.json", *TOKENIZER_FILES])
    logger.info("Hugging Face Hub tokenizer %s: revision %s is commit %s", repo_id,
                snap.revision_name, snap.commit)
    return snap


def download_weights(snap: HubSnapshot, show_progress: bool = True) -> list[str]:
    """Fetch the snapshot's weight files (those missing from the cache; none when it is
    complete: no request at all) and return their local paths. `show_progress`: the
    huggingface_hub progress bars (off on tensor-parallel ranks but the first)."""
    paths = [os.path.join(snap.path, name) for name in snap.weight_files]
    missing = [name for name, path in zip(snap.weight_files, paths) if not os.path.isfile(path)]
    if not missing:
        return paths
    from huggingface_hub import ResolvedRevision, constants, snapshot_download

    offline = constants.is_offline_mode()
    logger.info("Downloading %d weight file%s of %s from the Hugging Face Hub",
                len(missing), "" if len(missing) == 1 else "s", snap.describe())
    revision = ResolvedRevision(resolved=snap.commit, initial=snap.revision,
                                   repo_id=snap.repo_id)
    with _hub_errors(snap.repo_id, snap.revision, snap.cache_dir, offline):
        snapshot_download(snap.repo_id, revision=revision, cache_dir=snap.cache_dir,
                             allow_patterns=missing, local_files_only=offline,
                             tqdm_class=None if show_progress else _silent_tqdm())
    still = [name for name, path in zip(snap.weight_files, paths) if not os.path.isfile(path)]
    if still:
        raise ValueError(_not_cached(snap.repo_id, snap.revision, snap.cache_dir, offline,
                                     f"missing weight files: {_sample(still)}"))
    return paths


# ---- internals ---------------------------------------------------------------------------
def _fetch(repo_id: str, revision: str | None, download_dir: str | None,
           patterns: list[str]) -> tuple[HubSnapshot, list[str], bool]:
    """Resolve the revision, download the files matching `patterns`, return the snapshot, the
    repo's file list and whether that list is the repo's (huggingface_hub's cached listing
    of the commit) rather than what the snapshot folder holds (a cache made by hand or by an
    older huggingface_hub, read offline)."""
    from huggingface_hub import HfApi, constants, get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    cache_dir = os.path.abspath(os.path.expanduser(download_dir)) if download_dir else None
    offline = constants.is_offline_mode()
    with _hub_errors(repo_id, revision, cache_dir, offline):
        resolved = HfApi().resolve_revision(repo_id, revision=revision, cache_dir=cache_dir,
                                            local_files_only=offline)
        path = snapshot_download(repo_id, revision=resolved, cache_dir=cache_dir,
                                 allow_patterns=patterns, local_files_only=offline)
    try:
        listing = [f.path for f in get_cached_repo_tree(repo_id, revision=resolved,
                                                        cache_dir=cache_dir)]
        listed = True
    except CachedRepoTreeNotFoundError:
        listing, listed = _files_under(path), False
    snap = HubSnapshot(repo_id, revision, resolved.resolved, path, cache_dir)
    return snap, listing, listed


def _files_under(folder: str) -> list[str]:
    found = []
    for root, _, names in os.walk(folder):
        rel = os.path.relpath(root, folder)
        found += [name if rel == "." else f"{rel}/{name}".replace(os.sep, "/") for name in names]
    return sorted(found)


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _sample(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _silent_tqdm() -> type:
    from huggingface_hub.utils.tqdm import tqdm

    class Silent(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _where(repo_id: str, revision: str | None) -> str:
    return repo_id if revision is None else f"{repo_id} (revision {revision!r})"


def _cache_name(cache_dir: str | None) -> str:
    if cache_dir:
        return cache_dir
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _token_hint() -> str:
    from huggingface_hub import get_token

    if get_token():
        return "a token is set (HF_TOKEN or `hf auth login`), but it cannot read this repo"
    return "set HF_TOKEN to a token of an account that can read it"


def _not_cached(repo_id: str, revision: str | None, cache_dir: str | None, offline: bool,
                detail: str = "") -> str:
    what = f"Model {_where(repo_id, revision)} is not a local folder and"
    cache = _cache_name(cache_dir)
    detail = f" ({detail})" if detail else ""
    if offline:
        return (f"{what} is not (completely) in the Hugging Face cache {cache}{detail}, and "
                "HF_HUB_OFFLINE=1 forbids downloading it: download it once with network access "
                "or unset HF_HUB_OFFLINE")
    return (f"{what} the Hugging Face Hub could not be reached{detail}, and it is not "
            f"(completely) in the Hugging Face cache {cache}: check the network (or HF_ENDPOINT) "
            "and run again")


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, cache_dir: str | None,
                offline: bool) -> Iterator[None]:
    """huggingface_hub's errors as one-line ValueErrors that say what to do."""
    import httpx2
    from huggingface_hub import errors

    where = _where(repo_id, revision)
    try:
        yield
    except errors.GatedRepoError:
        raise ValueError(f"Model {repo_id} on the Hugging Face Hub is gated: accept its terms on "
                         f"its Hub page, and {_token_hint()}") from None
    except errors.RepositoryNotFoundError:
        raise ValueError(
            f"Model {repo_id!r} is neither a local folder nor a model repo on the Hugging Face "
            f"Hub; if it is a private or gated repo, {_token_hint()}") from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"Revision {revision!r} does not exist in {repo_id} on the Hugging Face "
                         "Hub (expected a branch, a tag or a commit sha)") from None
    except errors.IncompleteSnapshotError as exc:
        missing = re.search(r"(\d+ file\(s\) are missing \([^)]*\))", str(exc))
        raise ValueError(_not_cached(repo_id, revision, cache_dir, offline,
                                     missing.group(1) if missing else "")) from None
    except (errors.RevisionResolutionError, errors.LocalEntryNotFoundError,
            errors.OfflineModeIsEnabled):
        raise ValueError(_not_cached(repo_id, revision, cache_dir, offline)) from None
    except errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise ValueError(f"The Hugging Face Hub refused access to {where} (HTTP {status}): "
                             f"{_token_hint()}") from None
        raise ValueError(f"The Hugging Face Hub failed for {where}: {_first_line(exc)}") from exc
    except (httpx2.TransportError, OSError) as exc:
        # A download cut short (after huggingface_hub's own retries) or a cache that cannot be
        # written: files completed so far stay in the cache; partial ones are discarded.
        raise ValueError(
            f"Downloading {where} from the Hugging Face Hub failed ({type(exc).__name__}: "
            f"{_first_line(exc)}); the files completed so far stay in the cache "
            f"{_cache_name(cache_dir)}: run again to fetch the rest") from exc
