"""Pushing output folders to the Hugging Face Hub.

`push(folder, repo_id, ...)` verifies the folder (outputs.verify_checkpoint), refreshes the model card (card.py) with
the repo id, creates the repo if needed and uploads the folder with `HfApi.upload_folder`. With `hf_xet` installed (the
default) huggingface_hub streams the upload in batches and a re-run resumes it (committed files are skipped, uploaded
chunks deduplicated); without it, LFS objects already on the Hub are skipped on a re-run. Every network or Hub failure
becomes one `UserError` line.

The token comes from the `token` argument, else `HF_TOKEN`, else the stored login (`hf auth login`); it is passed to
huggingface_hub and never logged or put into a message. The endpoint is `HF_ENDPOINT` as set when `push` runs (else
huggingface_hub's default), which is how the tests point pushes at a local stand-in (tests/hub_standin.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

from mla_convert import provenance
from mla_convert.card import CARD_FILENAME, render_model_card, write_model_card
from mla_convert.errors import UserError
from mla_convert.outputs import OWN_FILES, _SHARD, glob_escape, verify_checkpoint
from mla_convert.sources import AUX_FILES
from mla_convert.writes import is_no_room, room_for

log = logging.getLogger(__name__)

# Never uploaded: hidden files and everything in hidden folders (mla-convert writes none into an output folder; they
# are a user's or a tool's: .git, .env, .cache/huggingface/ where huggingface_hub keeps its upload state, editor and
# notebook state), temporary files of an interrupted write, Python caches. fnmatch's `*` also matches `/`, so ".*"
# is a hidden entry at the top and "*/.*" one at any depth.
HIDDEN_PATTERNS = [".*", "*/.*"]
IGNORE_PATTERNS = HIDDEN_PATTERNS + ["*.tmp", "*.partial", "*/__pycache__/*", "__pycache__/*"]
# Remote files that a push deletes when the folder no longer has them: stale shards of an earlier, differently
# sharded upload would otherwise stay in the repo next to the new index.
STALE_WEIGHT_PATTERNS = ["model*.safetensors", "model.safetensors.index.json"]
_NO_TOKEN = "no Hugging Face token found: run `hf auth login` or set HF_TOKEN to a token with write access"


@dataclasses.dataclass
class PushResult:
    repo_id: str
    files: list[tuple[str, int]]  # (path in repo, bytes), sorted
    dry_run: bool
    revision: str
    private: bool
    created: bool | None = None  # None: not known (dry run)
    commit_oid: str | None = None
    commit_url: str | None = None
    hidden: list[str] = dataclasses.field(default_factory=list)  # hidden files and folders left out of the upload
    foreign: list[str] = dataclasses.field(default_factory=list)  # visible files mla-convert did not write: left out

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


# What mla-convert writes into an output folder (convert, export, finetune's final/): only these are pushed. A user's
# other files stay out (named by the push), so a token file or private notes beside the model never reach the Hub.
_OWN_EXTRA = ("metrics.jsonl", "loss.png")  # finetune's final/
_OWN_NESTED = re.compile(r"additional_chat_templates/[^/]+\.jinja")  # a tokenizer's named chat templates
# A Hugging Face access token (user or organization): a file that holds one is refused, whatever its name.
TOKEN_PATTERN = re.compile(rb"\b(hf_|api_org_)[A-Za-z0-9]{30,}")
_SCANNED_BYTES = 64 * 2**20  # text files are scanned whole; weights (safetensors) by their JSON header


def _is_own(rel: str) -> bool:
    return (rel in OWN_FILES or rel in AUX_FILES or rel in _OWN_EXTRA or bool(_SHARD.fullmatch(rel))
            or bool(_OWN_NESTED.fullmatch(rel)))


def _visible(folder: Path) -> list[str]:
    from huggingface_hub.utils import filter_repo_objects

    entries = [p.relative_to(folder).as_posix() for p in sorted(folder.glob("**/*"))
               if p.is_symlink() or p.is_file()]
    return list(filter_repo_objects(entries, ignore_patterns=IGNORE_PATTERNS))


def upload_files(folder: str | os.PathLike) -> list[tuple[str, int]]:
    """The files a push uploads: (path relative to the folder, bytes): the visible files mla-convert writes (its own
    names), never a link, each checked for an access token."""
    folder = Path(folder).resolve()
    files = []
    for rel in _visible(folder):
        path = folder / rel
        if not _is_own(rel):
            continue
        if path.is_symlink() or path.resolve() != folder / rel:  # the file itself or a folder on its way
            raise UserError(f"{path} is a symbolic link: push uploads only files mla-convert wrote, never through a "
                            "link; replace it with the file itself or remove it")
        _refuse_credentials(path)
        files.append((rel, path.stat().st_size))
    return files


def left_out(folder: str | os.PathLike) -> list[str]:
    """Visible files in `folder` that mla-convert did not write (a user's notes, links): never pushed, named."""
    folder = Path(folder).resolve()
    return [rel for rel in _visible(folder) if not _is_own(rel)]


def _refuse_credentials(path: Path) -> None:
    """Refuse a file that holds something shaped like a Hugging Face token (its value is never shown)."""
    import json
    import struct

    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            data = f.read(min(size, 100 * 2**20))
        else:
            data = f.read(_SCANNED_BYTES)
    found = TOKEN_PATTERN.search(data)
    if found is None and path.suffix == ".json":  # escaped in JSON text: look at the decoded strings as well
        try:
            text = json.dumps(json.loads(data), ensure_ascii=False).encode()
            found = TOKEN_PATTERN.search(text)
        except (ValueError, RecursionError):
            pass
    if found is not None:
        raise UserError(f"{path} holds what looks like a Hugging Face access token ({found.group(1).decode()}...): "
                        "nothing was pushed; remove the token from the file (and revoke it if it was ever shared)")


def hidden_entries(folder: str | os.PathLike) -> list[str]:
    """The hidden files and folders at the top of `folder` or in its subfolders that a push leaves out (a hidden
    folder is named once, not file by file), sorted."""
    folder = Path(folder).resolve()
    found = []
    for path in sorted(folder.rglob(".*")):
        rel = path.relative_to(folder)
        if not any(part.startswith(".") for part in rel.parts[:-1]):  # not inside a hidden folder already named
            found.append(rel.as_posix() + ("/" if path.is_dir() else ""))
    return found


def _hub_message(err) -> str:
    """The server's own words from an HfHubHTTPError, one line."""
    server = getattr(err, "server_message", None)
    text = server or str(err)
    return " ".join(text.split())[:300]


def _translate(err: Exception, repo_id: str, endpoint: str, what: str) -> UserError:
    """One clear line for a failure talking to the Hub (never containing the token)."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, HFValidationError):
        return UserError(f"invalid repo id {repo_id!r}: use NAMESPACE/NAME, e.g. my-user/my-model-mla")
    if isinstance(err, OfflineModeIsEnabled):
        return UserError("HF_HUB_OFFLINE is set: unset it to push to the Hub")
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code if err.response is not None else None
        if status == 401:
            return UserError(f"the Hub at {endpoint} rejected the token (401 Unauthorized) while {what}: run "
                             "`hf auth login` or set HF_TOKEN to a valid token with write access")
        if status == 403:
            return UserError(f"no write access to {repo_id} (403 Forbidden) while {what}: check the namespace and "
                             "that the token has write permission")
        if isinstance(err, RevisionNotFoundError):
            return UserError(f"revision not found in {repo_id} while {what}: check --revision")
        if isinstance(err, RepositoryNotFoundError):
            return UserError(f"repository {repo_id} not found while {what} (or the token cannot see it)")
        return UserError(f"the Hub answered {status} while {what}: {_hub_message(err)}; re-run the same command to "
                         "resume the upload")
    return UserError(f"cannot reach the Hub at {endpoint} while {what} ({err.__class__.__name__}): check the network "
                     "connection or HF_ENDPOINT, then re-run the same command to resume")


def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx", "requests"):  # whichever HTTP client this huggingface_hub version uses
        try:
            mod = __import__(module)
        except ImportError:
            continue
        for name in ("TransportError", "ConnectionError", "Timeout"):
            cls = getattr(mod, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                errors.append(cls)
    return tuple(errors)


@dataclasses.dataclass
class _Step:
    """What a push is doing at the moment: named in the one line a Hub failure becomes."""

    what: str


def _check_repo_id(repo_id: str) -> None:
    """Refuse a repo id the Hub would not take, or one without a namespace."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise _translate(e, repo_id, "", "checking the repo id") from None
    if "/" not in repo_id:
        raise UserError(f"repo id {repo_id!r} has no namespace: use NAMESPACE/NAME, e.g. my-user/{repo_id}")


def _planned(folder: Path, repo_id: str, dry_run: bool, branch: str, private: bool) -> PushResult:
    """Verify the folder and list what a push uploads (README.md with the size the refreshed card will have)."""
    verify_checkpoint(folder)
    # The card is (re)written with the repo id just before the upload: list it with the size it will have.
    card_bytes = len(render_model_card(folder, repo_id).encode())
    files = sorted([f for f in upload_files(folder) if f[0] != CARD_FILENAME] + [(CARD_FILENAME, card_bytes)])
    return PushResult(repo_id=repo_id, files=files, dry_run=dry_run, revision=branch, private=private,
                      hidden=hidden_entries(folder), foreign=left_out(folder))


def _ensure_repo(api, repo_id: str, private: bool, result: PushResult, step: _Step) -> None:
    """Create the model repo, or take an existing one the token may write to; sets `result.created`."""
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        api.create_repo(repo_id, private=private or None, repo_type="model", exist_ok=False)
        result.created = True
        log.info("created %s%s", repo_id, " (private)" if private else "")
        return
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 409:
            result.created = False
        elif status == 403:  # a token without the create scope may still write to an existing repo
            step.what = "checking the existing repo"
            try:
                api.repo_info(repo_id, repo_type="model")
            except RepositoryNotFoundError:
                raise UserError(f"cannot create {repo_id} (403 Forbidden: {_hub_message(e)}) and no repo of that "
                                "name is visible to the token: check the namespace (your user or an organization "
                                "you can write to)") from None
            result.created = False
        else:
            raise
    log.info("%s exists: updating it", repo_id)


def _upload(api, folder: Path, repo_id: str, private: bool, branch: str, commit_message: str | None,
            result: PushResult, step: _Step):
    """Create the repo (and branch), refresh the card with the repo id, upload the files checked; returns the
    commit info. `step` says what it is doing when something fails."""
    from huggingface_hub import constants

    _ensure_repo(api, repo_id, private, result, step)
    if branch != constants.DEFAULT_REVISION:
        step.what = f"creating branch {branch}"
        api.create_branch(repo_id, branch=branch, repo_type="model", exist_ok=True)
    # The card names the repo in its loading examples: refreshed only now that the repo is known to be writable
    # (a refused push leaves the folder as it was).
    try:
        write_model_card(folder, repo_id=repo_id)
    except OSError as e:
        if is_no_room(e):
            raise  # a full disk: `push` names the room it needs
        raise UserError(f"cannot update the model card {folder / CARD_FILENAME} ({e.strerror or e}): push from a "
                        "folder you can write to") from None
    result.files = upload_files(folder)
    step.what = "uploading"
    message = commit_message or f"Upload MLA model ({(provenance.load(folder) or {}).get('kind', 'convert')}) " \
                                "with mla-convert"
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        repo_type="model",
        revision=branch,
        commit_message=message,
        allow_patterns=[glob_escape(rel) for rel, _ in result.files],  # only the files checked above
        ignore_patterns=list(IGNORE_PATTERNS),
        delete_patterns=list(STALE_WEIGHT_PATTERNS),
    )


def _hub_cause(err: BaseException, network: tuple[type[BaseException], ...]) -> BaseException | None:
    """The Hub, validation, offline or network error in `err`'s chain of causes, None if there is none:
    huggingface_hub sometimes wraps the HTTP error (e.g. "Error while uploading 'x' to the Hub.")."""
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled

    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, (HfHubHTTPError, HFValidationError, OfflineModeIsEnabled,
                                                       *network)):
        cause = cause.__cause__ or cause.__context__
    return cause


def push(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    token: str | None = None,
) -> PushResult:
    """Upload a verified output folder to the Hub model repo `repo_id`; returns what was (or would be) uploaded.

    Order: verify the folder (`UserError` if incomplete) -> list the files (README.md with the size the refreshed
    card will have) -> (dry run: stop; nothing written, no network, no token needed) -> token (argument, HF_TOKEN,
    stored login; `UserError` if none) -> create the repo at the endpoint (HF_ENDPOINT as set now, else
    huggingface_hub's) (`private` applies only to a new repo; an existing one is updated when the token may write to
    it) -> create branch `revision` if it is not main -> refresh the model card with `repo_id` -> upload the folder as
    one logical commit (huggingface_hub may split a very large folder into several) deleting remote weight files the
    folder no longer has. A re-run of an interrupted push resumes it. Network and Hub errors raise `UserError` with
    one line that never contains the token; a push refused before the upload leaves the folder unchanged.
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import get_token

    folder = Path(folder)
    _check_repo_id(repo_id)
    branch = revision or constants.DEFAULT_REVISION
    result = _planned(folder, repo_id, dry_run, branch, private)
    if dry_run:
        return result

    token = token or get_token()
    if not token:
        raise UserError(_NO_TOKEN)

    # HF_ENDPOINT read now, not only when huggingface_hub was imported (it may have been imported before the variable
    # was set, e.g. by transformers in the same process); unset means huggingface_hub's default.
    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token)
    network = _network_errors()
    step = _Step("creating the repo")
    # what the push writes in the folder: the refreshed card, and huggingface_hub's upload records (one a file)
    card = folder / CARD_FILENAME
    local = (card.stat().st_size if card.is_file() else 0) + 8192 + 1024 * len(result.files)
    try:
        with room_for(folder, local, "the push's card and upload records in"):
            info = _upload(api, folder, repo_id, private, branch, commit_message, result, step)
    except UserError:
        raise
    except Exception as e:
        cause = _hub_cause(e, network)
        if cause is None:
            raise
        raise _translate(cause, repo_id, endpoint, step.what) from None
    result.commit_oid = getattr(info, "oid", None)
    result.commit_url = getattr(info, "commit_url", None)
    log.debug("pushed %d files (%d bytes) to %s", len(result.files), result.total_bytes, repo_id)
    return result
