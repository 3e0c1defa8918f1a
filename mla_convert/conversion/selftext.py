"""Data-free text: token sequences sampled from the source model itself (`--calib-data self`, `finetune --data self`).

Two styles, sampled by `mla_convert.sampler` (`batch` sequences a step, each in its own slot of a preallocated cache,
in `sampling_dtype`) from softmax(logits / temperature) over the whole vocabulary, at the temperature
`calib_temperature` gives for calibration (`--calib-temperature`) and at `TEMPERATURE` for fine-tuning text. Sample i
draws its uniforms from a generator seeded with seed * 1_000_003 + i alone, so its text does not depend on the samples
beside it (beyond the arithmetic's rounding, hence `batch` in the cache key):

- `self` (chat): `SAMPLE_TOKENS` new tokens per sequence. An instruct model (its tokenizer has a chat template) answers
  the built-in requests of `PROMPTS` through that template, so the text is what it writes in use; a base model
  continues its BOS token. Each sample is the whole sequence the model saw (template, request, answer, up to and with
  its EOS).
- `self-doc` (document): one unbroken document per calibration window, continued from the BOS token alone with EOS
  suppressed until the window is full, so the statistics see one text over every distance a window spans (chat
  answers are a few hundred tokens each: in a 2048-token window most distances cross from one answer to another).

The samples are joined, in their order, into one token stream that is cut into windows.

Sampled text is cached as plain JSON (token ids plus the decoded text, for reading), one file per source
fingerprint, seed, sampling settings and (chat) prompt list, under $MLA_CONVERT_CACHE/self-text (default
~/.cache/mla-convert): a second conversion reads them instead of sampling again, and a longer request samples only the
samples it lacks (from the first one the cache does not hold).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from mla_convert import dtypes, policy
from mla_convert.errors import UserError
from mla_convert.schema import DEFAULTS

log = logging.getLogger(__name__)

SELF = "self"  # chat style
SELF_DOC = "self-doc"  # document style
STYLES = {SELF: "chat", SELF_DOC: "document"}
# Fine-tuning text (`finetune --data self`): temperature 1, the model's own distribution. Calibration text
# (`--calib-data self`, `--calib-temperature`): `calib_temperature`, by the share of the source's cache the conversion
# keeps. Temperature, length and batch: docs/decisions.md#self-text-temperature-length-and-batch.
TEMPERATURE = 1.0
CALIB_TEMPERATURE = policy.CALIB_TEMPERATURE[0]  # the narrow latents' (the wide ones': TEMPERATURE)
SAMPLE_TOKENS = DEFAULTS["calib_sample_tokens"]  # the option's default: mla_convert/schema.py
BATCH = 64  # sequences a step on a CPU (benchmarks/convert/README.md#the-self-texts-sampler)
DOC_BATCH = 8  # documents are a calibration window long (2048 tokens): fewer at once
# On a CUDA device a step is cheap in width and dear in count: the samples of a whole calibration at once. Sample i
# answers PROMPTS[i % len(PROMPTS)] whatever the batch.
CUDA_BATCH = 256
CUDA_DOC_BATCH = 64
WRITE_EVERY_S = 30.0  # the cache file is rewritten whole: at most this often while sampling, and at the end
# Bump when the sampling procedure changes: old cache files are then not read. 1: transformers' `generate` in batches
# seeded per batch; 2: `mla_convert.sampler`, seeded per sample (its prompt store changed no sampled token).
CACHE_VERSION = 2
# The hash of the 24-request list the first cache files were sampled with (the first 24 of PROMPTS): their key omits
# it. Any other list (PROMPTS since, or one set for an experiment) is added to the key, so it never reads their text.
CACHED_PROMPTS = "bd52d72160f6eb3a"

# Requests of many kinds (prose, technical documentation, code, dialogue, lists), so that the calibration text covers
# more than one register. They are instructions, not data: the text is the model's own. 96 of them, so that the 16
# calibration windows answer each about once (docs/decisions.md#self-text-the-prompt-pool).
PROMPTS = [
    "Write a short encyclopedia article about a historical city.",
    "Explain how to configure a network interface on a Linux server, with example commands.",
    "Write a Python function that parses a CSV file, and explain how it works.",
    "Tell me a story about a sailor who gets lost at sea.",
    "What are the main causes of climate change? Answer in detail.",
    "Write the installation section of the manual of a command-line tool.",
    "Summarize the rules of chess for a beginner.",
    "Write a letter to a friend describing your holiday in the mountains.",
    "Explain the difference between a process and a thread, with a C example.",
    "Describe the life of a famous painter.",
    "Give me a recipe for bread and explain each step.",
    "Write coding guidelines for a team that maintains a large C project.",
    "Explain how vaccines train the immune system.",
    "Write a dialogue between a teacher and a student about fractions.",
    "Describe the geography and economy of a country in South America.",
    "Write a bash script that backs up a folder every night, with comments.",
    "Explain what a database index is and when to use one.",
    "Write a review of a science fiction novel.",
    "List ten tips for writing clear documentation, with a sentence on each.",
    "Explain the causes and consequences of a major war of the 19th century.",
    "Write a short poem about autumn, then explain its imagery.",
    "How does public-key cryptography work? Give an example.",
    "Write the README of an open-source library for date handling.",
    "Describe how a bill becomes a law in a parliamentary democracy.",
    "Write an encyclopedia entry about a river and the towns along it.",
    "Write the history of a medieval castle, from its construction to today.",
    "Describe the career of a 20th-century scientist and what she discovered.",
    "Write an article about a species of bird: habitat, behaviour and conservation.",
    "Explain the history of the printing press and its effects on Europe.",
    "Write an encyclopedia article about a football club and its best seasons.",
    "Describe an ancient empire: its rise, its government and its fall.",
    "Write a biography of a composer of the classical period.",
    "Write an article about a volcano and its major eruptions.",
    "Describe the plot and reception of a famous film of the 1950s.",
    "Write an encyclopedia entry about a naval battle.",
    "Describe the architecture of a cathedral, part by part.",
    "Write the man page of a command-line program that compresses files.",
    "Explain how to set up a web server with nginx, step by step.",
    "Write the changelog of a software project's last three releases.",
    "Document the configuration options of a logging library.",
    "Explain how Git branches and merges work, with commands.",
    "Write the troubleshooting section of a printer's user manual.",
    "Explain how to write a Makefile for a small C program.",
    "Describe the packaging policy of a Linux distribution for new maintainers.",
    "Write a guide to the file system hierarchy of a Unix system.",
    "Explain what a software license is and compare two common ones.",
    "Write the API reference of a small HTTP client library.",
    "Explain how to report a bug so that developers can fix it.",
    "Write a JavaScript function that validates a form, with comments.",
    "Implement a linked list in C and explain each function.",
    "Write a SQL query that finds the top customers by revenue, and explain it.",
    "Write a Rust program that counts words in a file.",
    "Explain recursion with a Python example that walks a directory tree.",
    "Write unit tests for a function that parses dates.",
    "Write a short story about a child who finds a key in the garden.",
    "Tell the story of a village that loses its river.",
    "Write a fable about a fox and a crow, with a moral.",
    "Write the opening chapter of a detective novel set in a port city.",
    "Tell a story about two brothers who travel across a desert.",
    "Write a diary entry of an explorer in the Arctic.",
    "Explain how the stock market works to a new investor.",
    "Explain the theory of evolution by natural selection.",
    "What were the causes of the French Revolution?",
    "Explain how electricity is generated and distributed to homes.",
    "Explain the water cycle and why it matters for agriculture.",
    "How does the human heart work? Answer in detail.",
    "Explain how an airplane stays in the air.",
    "Explain inflation and how central banks respond to it.",
    "Describe the main schools of ancient Greek philosophy.",
    "Explain how a compiler turns source code into machine code.",
    "Explain plate tectonics and how mountains form.",
    "What is the role of the judiciary in a democracy?",
    "List the steps to plant and care for an apple tree.",
    "Give instructions for changing a flat tyre on a bicycle.",
    "List the main events of the Second World War in order, with dates.",
    "Give a study plan for learning a foreign language in six months.",
    "List the planets of the solar system with a paragraph on each.",
    "Write a checklist for releasing a new version of a software package.",
    "Write a news report about the opening of a new railway line.",
    "Write a newspaper article about a local election.",
    "Write a report on the results of a scientific experiment on plant growth.",
    "Write the minutes of a meeting of a town council.",
    "Write a formal complaint letter to a telephone company.",
    "Write a speech for the opening of a public library.",
    "Summarize the history of the Olympic Games.",
    "Describe the music and culture of a region of West Africa.",
    "Describe the climate and wildlife of a tropical rainforest.",
    "Write a travel guide to an old European capital.",
    "Explain the rules of cricket to someone who has never seen it.",
    "Describe how a modern newspaper is produced, from reporting to print.",
    "Write a dialogue between a doctor and a patient about a persistent cough.",
    "Write an interview with a retired teacher about her career.",
    "Write a debate between two people about nuclear power.",
    "Explain the difference between weather and climate, with examples.",
    "Describe the life cycle of a star.",
    "Write the style guide section of a project's contributing documentation.",
]


def length_args(name: str, seq_len: int, sample_tokens: int | None = None) -> dict:
    """Sampling arguments of `self` / `self-doc` text cut into `seq_len` windows: one document a window, or chat
    answers of `sample_tokens` at most (None: the default)."""
    if name == SELF_DOC:
        return dict(sample_tokens=seq_len, style=STYLES[SELF_DOC])
    return {} if sample_tokens is None else dict(sample_tokens=sample_tokens)


def calib_temperature(kept: float) -> float:
    """The default temperature of `self` calibration text for a conversion that keeps `kept` (a fraction) of the
    source's KV cache (`policy.CALIB_TEMPERATURE`): above 1 for small latents, else 1, the model's own distribution.

    A small latent gains from text that covers more of what it can be asked; a wide one from the text the model
    writes: chosen on the development split, docs/decisions.md#self-text-temperature-length-and-batch."""
    return policy.by_cache_kept(kept, policy.CALIB_TEMPERATURE)


def cache_dir() -> Path:
    root = os.environ.get("MLA_CONVERT_CACHE") or Path.home() / ".cache" / "mla-convert"
    return Path(root).expanduser() / "self-text"


def source_fingerprint(source) -> dict:
    """What the sampled text depends on: the source's origin and its files (path, size, modification time)."""
    from mla_convert.sources import file_stamp

    return {"origin": source.origin, "files": [file_stamp(p) for p in source.files() if p.is_file()]}


def causal_lm(source, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The source as a transformers causal LM (its tensors read through `source`) on `device` in `dtype`, for
    sampling."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(source.config, dtype=dtype)
    state = {name: read().to(device=device, dtype=dtype) for name, read in source.stored().items()}
    missing, _ = model.load_state_dict(state, strict=False, assign=True)
    for parent in list(model.modules()):  # rotary embeddings hold computed buffers (inv_freq): build them for real
        for name, child in parent.named_children():
            if any(n.endswith("inv_freq") for n, _ in child.named_buffers(recurse=False)):  # Gemma 3: one per type
                setattr(parent, name, type(child)(config=source.config).to(device))
        if hasattr(parent, "scalar_embed_scale"):  # Gemma's scaled embedding keeps its scale in a computed buffer
            parent.embed_scale = torch.tensor(parent.scalar_embed_scale, device=device)
    if getattr(source.config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing:
        raise UserError(f"{source.origin} lacks {missing[0]} (and {len(missing) - 1} more tensors): the text sampled "
                        "from it would be noise; pass --calib-data FILE")
    model.generation_config.pad_token_id = None  # set per call; the source's own sampling defaults are not used
    return model.eval()


def prompts(tokenizer, first: int, count: int, style: str = "chat") -> list[list[int]]:
    """Token ids of `count` prompts, the first being PROMPTS[first] (cycling): chat-templated requests for a model
    with a chat template (chat style), else its BOS (or EOS) token alone."""
    if style == "chat" and getattr(tokenizer, "chat_template", None):
        from mla_convert.templates import apply_chat_template

        out = []
        for i in range(first, first + count):
            ids = apply_chat_template(tokenizer, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                      "the source", add_generation_prompt=True, tokenize=True)
            out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
        return out
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start is None:
        raise UserError("the source's tokenizer has neither a chat template nor a BOS/EOS token to start sampling "
                        "from: pass --calib-data FILE")
    return [[start]] * count


def prompt_tokens(tokenizer, style: str = "chat") -> tuple[float, int]:
    """(the mean length of the sampler's prompts, the length of the prefix they all share) (chat: the templated
    PROMPTS; a document: its BOS alone, nothing shared)."""
    table = prompts(tokenizer, 0, len(PROMPTS) if style == "chat" else 1, style)
    shared = 0
    while len(table) > 1 and all(len(p) > shared + 1 and p[shared] == table[0][shared] for p in table):
        shared += 1
    return sum(map(len, table)) / len(table), shared


def requests(tokenizer, first: int, seed: int, sample_tokens: int, style: str, limit: int | None):
    """The sampler's requests from sample `first` on (endless), and the positions the longest needs: sample i answers
    PROMPTS[i % len(PROMPTS)] (chat; a document continues BOS) with the uniforms of seed `seed` * 1_000_003 + i;
    chat answers take at most `sample_tokens` new tokens, documents are `sample_tokens` long with EOS suppressed, both
    within the model's `limit` positions."""
    from mla_convert.sampler import Request

    table = prompts(tokenizer, 0, len(PROMPTS) if style == "chat" else 1, style)
    document = style == "document"

    def new(prompt: list[int]) -> int:
        n = sample_tokens - len(prompt) if document else sample_tokens
        return max(1, min(n, limit - len(prompt)) if limit else n)

    def endless():
        i = first
        while True:
            prompt = table[i % len(table)]
            yield Request(prompt, new(prompt), seed * 1_000_003 + i, suppress_eos=document)
            i += 1

    return endless(), max(len(p) + new(p) for p in table)


def sample_stream(model, tokenizer, first: int, seed: int, temperature: float, sample_tokens: int, width: int,
                  style: str = "chat", budget: int | None = None):
    """Samples `first`, `first` + 1, ... of the seeded sampling (`mla_convert.sampler`, `width` at once), each a token
    list (chat: prompt + answer, cut after the first EOS; document: BOS + `sample_tokens` - 1 tokens, EOS
    suppressed), until they hold `budget` tokens."""
    from mla_convert.sampler import sample

    limit = getattr(model.config, "max_position_embeddings", None)
    todo, length = requests(tokenizer, first, seed, sample_tokens, style, limit)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return sample(model, todo, width, temperature, tokenizer.eos_token_id, length, pad=pad, budget=budget)


def self_tokens(source, n_tokens: int, seed: int, temperature: float | None = None,
                sample_tokens: int | None = None, batch: int | None = None, style: str = "chat",
                device: str = "cpu") -> torch.Tensor:
    """A stream of at least `n_tokens` token ids [N] sampled from `source` (cached; see the module docstring),
    `batch` samples at a time (default: `default_batch`), at `temperature` (default TEMPERATURE) and `sample_tokens`
    (default SAMPLE_TOKENS) a sample. In the document style every `sample_tokens` ids are one document. The source
    samples in `sampling_dtype`: on a CUDA `device`, and on a CPU with bfloat16 arithmetic, in bfloat16, whose
    rounding gives other text, cached under its own key."""
    settings, path = _entry(source, seed, temperature, sample_tokens, batch, style, device)
    temperature, sample_tokens, batch = settings["temperature"], settings["sample_tokens"], settings["batch"]
    batches = read_cache(path, settings)
    have = sum(len(s) for b in batches for s in b["tokens"])
    if have < n_tokens:
        model, tokenizer = _sampling_model(source, device)
        log.info("sampling %d tokens of %s text from the source on %s (temperature %g, cached in %s)",
                 n_tokens - have, style, device, temperature, path)
        written, group = time.monotonic(), []
        first = sum(len(b["tokens"]) for b in batches)
        for tokens in sample_stream(model, tokenizer, first, seed, temperature, sample_tokens, batch, style,
                                    budget=n_tokens - have):
            group.append(tokens)
            have += len(tokens)
            if time.monotonic() - written > WRITE_EVERY_S:  # an interrupted run keeps what it sampled until then
                _keep(path, settings, batches, group, tokenizer)
                written, group = time.monotonic(), []
                log.info("sampled %d of %d tokens", have, n_tokens)
        _keep(path, settings, batches, group, tokenizer)
        del model
    return torch.tensor([t for b in batches for s in b["tokens"] for t in s], dtype=torch.long)


class Stream:
    """An endless self-text token stream, read as far as it is needed: the cached samples first, then new samples
    (which are cached as they come) from sample `first` on, so that a reader that comes back for more (the
    fine-tuning loop, `data=self` without a pool) is fed text nobody has read yet, and a resumed run reads back the
    same text. The sampler's slots stay open between requests, so asking for a little at a time costs no more than
    asking for everything at once. `tokens` is the stream as a list of ids; `ends` the end offset of each sample."""

    def __init__(self, source, seed: int, temperature: float | None = None, sample_tokens: int | None = None,
                 batch: int | None = None, style: str = "chat", device: str = "cpu"):
        self.source, self.seed, self.style, self.device = source, seed, style, device
        self.settings, self.path = _entry(source, seed, temperature, sample_tokens, batch, style, device)
        self.batches: list[dict] = []
        self.tokens: list[int] = []
        self.ends: list[int] = []
        self.sampled = 0  # tokens this process sampled (not read back from the cache)
        self.seconds = 0.0  # time it spent sampling them (loading the model included)
        self._group: list[list[int]] = []  # sampled, not yet written to the cache
        self._samples = None  # the open sampler (a generator), once the cache runs out
        self._tokenizer = None
        self._written = time.monotonic()
        self.reload()

    def reload(self) -> None:
        """Read the cache again (what another process sampled since); only while this process holds unwritten
        samples of its own is it left as it is."""
        if self._group or self._samples is not None:
            return
        self.batches = read_cache(self.path, self.settings)
        self.tokens, self.ends = [], []
        for b in self.batches:
            for s in b["tokens"]:
                self.tokens.extend(s)
                self.ends.append(len(self.tokens))

    def ensure(self, n_tokens: int) -> None:
        """Sample until the stream holds at least `n_tokens` ids (the cache is written at most every WRITE_EVERY_S
        while sampling; `flush` writes the rest)."""
        if len(self.tokens) >= n_tokens:
            return
        t0 = time.perf_counter()
        if self._samples is None:
            s = self.settings
            model, self._tokenizer = _sampling_model(self.source, self.device)
            log.info("sampling %s text from the source on %s as it is read (temperature %g, from sample %d; cached "
                     "in %s)", self.style, self.device, s["temperature"], len(self.ends), self.path)
            self._samples = sample_stream(model, self._tokenizer, len(self.ends), self.seed, s["temperature"],
                                          s["sample_tokens"], s["batch"], self.style)
        while len(self.tokens) < n_tokens:
            sample = next(self._samples)
            self._group.append(sample)
            self.tokens.extend(sample)
            self.ends.append(len(self.tokens))
            self.sampled += len(sample)
        self.seconds += time.perf_counter() - t0
        if time.monotonic() - self._written > WRITE_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Write the samples not yet cached."""
        if self._group:
            _keep(self.path, self.settings, self.batches, self._group, self._tokenizer)
            self._group = []
        self._written = time.monotonic()

    def close(self) -> None:
        """Write what is left and let the sampler (and its copy of the source) go."""
        self.flush()
        self._samples = None


def _sampling_model(source, device: str):
    """(the source as a causal LM in `sampling_dtype` on `device`, its tokenizer), refused first where it does not
    fit in a CPU's memory."""
    if torch.device(device).type != "cuda":
        check_memory(source)
    return causal_lm(source, device, sampling_dtype(source, device)), source.tokenizer()


def _keep(path: Path, settings: dict, batches: list[dict], group: list[list[int]], tokenizer) -> None:
    """Add the samples `group` to the cached `batches` as one batch, and write the cache."""
    if group:
        batches.append({"tokens": group, "text": [tokenizer.decode(t) for t in group]})
    write_cache(path, settings, batches)


def sampling_dtype(source, device: str = "cpu") -> torch.dtype:
    """What the source samples in: bfloat16 on a GPU and on CPUs where the source computes faster in it
    (`dtypes.cpu_prefers_bf16`), else float32. Why bfloat16 is the same distribution's text:
    docs/decisions.md#self-text-temperature-length-and-batch."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    hidden = getattr(source.config, "hidden_size", 0) or 0
    return torch.bfloat16 if dtypes.cpu_prefers_bf16(hidden) else torch.float32


def _entry(source, seed: int, temperature: float | None, sample_tokens: int | None, batch: int | None, style: str,
           device: str) -> tuple[dict, Path]:
    """The cache settings and file of a `self_tokens` request, its defaults filled in."""
    on_cuda = torch.device(device).type == "cuda"
    batch = batch or default_batch(device, style == "document")
    temperature = TEMPERATURE if temperature is None else temperature
    sample_tokens = SAMPLE_TOKENS if sample_tokens is None else sample_tokens
    if not temperature > 0 or sample_tokens <= 0:
        raise UserError("self-generated text needs a positive temperature and sample length")
    bf16 = not on_cuda and sampling_dtype(source, device) == torch.bfloat16
    return cache_entry(source, seed, temperature, sample_tokens, batch, style, "cuda" if on_cuda else None,
                       "bfloat16" if bf16 else None)


def default_batch(device: str = "cpu", document: bool = False) -> int:
    """The sequences sampled at once on `device` by default (documents: DOC_BATCH, CUDA_DOC_BATCH)."""
    if torch.device(device).type == "cuda":
        return CUDA_DOC_BATCH if document else CUDA_BATCH
    return DOC_BATCH if document else BATCH


def missing_tokens(source, n_tokens: int, seed: int, temperature: float | None = None,
                   sample_tokens: int | None = None, batch: int | None = None, style: str = "chat",
                   device: str = "cpu") -> int:
    """How many of the `n_tokens` a `self_tokens` request asks for are not cached yet (what it would sample)."""
    settings, path = _entry(source, seed, temperature, sample_tokens, batch, style, device)
    return max(0, n_tokens - sum(len(s) for b in read_cache(path, settings) for s in b["tokens"]))


def available_memory() -> int | None:
    """Bytes of memory the kernel can give without swapping (Linux' MemAvailable), None where that is unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(source) -> None:
    """Sampling holds the whole source (in `sampling_dtype`), unlike the conversion, which streams one layer at a
    time: refuse, before loading it, a source that does not fit, and name the fix (a calibration file, or a cached
    self text)."""
    embed = "model.embed_tokens.weight"
    element = source.element_size(embed) if source.has(embed) else 4
    dtype = sampling_dtype(source)
    need = source.nbytes() * dtype.itemsize // max(element, 1)
    have = available_memory()
    if have is not None and need > 0.9 * have:
        name = str(dtype).removeprefix("torch.")
        raise UserError(f"--calib-data self samples text from the whole source in {name} ({need / 2**30:.1f} GiB), "
                        f"more than the {have / 2**30:.1f} GiB available here: pass --calib-data FILE (any text you "
                        "do not evaluate on), or sample once on a larger machine (the text is cached, see "
                        "MLA_CONVERT_CACHE)")


def cache_entry(source, seed: int, temperature: float, sample_tokens: int, batch: int,
                style: str = "chat", device: str | None = None, dtype: str | None = None) -> tuple[dict, Path]:
    """(the settings the sampled text depends on, the cache file that holds it); `device` names a sampling device
    other than the CPU (None: the CPU, whose caches predate the key), `dtype` a CPU's sampling precision other than
    float32 (None: float32, whose caches predate the key)."""
    settings = {"version": CACHE_VERSION, "source": source_fingerprint(source), "seed": seed,
                "temperature": temperature, "sample_tokens": sample_tokens, "batch": batch}  # fmt: skip
    if device is not None:
        settings["device"] = device
    if dtype is not None:
        settings["dtype"] = dtype
    if style != "chat":  # keyed only when not chat: the chat caches written before styles existed stay valid
        settings["style"] = style
    elif (prompts_key := hashlib.sha256(json.dumps(PROMPTS).encode()).hexdigest()[:16]) != CACHED_PROMPTS:
        settings["prompts"] = prompts_key  # another request list is other text (the caches made before stay valid)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]
    return settings, cache_dir() / f"{key}.json"


def read_cache(path: Path, settings: dict) -> list[dict]:
    """The cached batches of `path`, or [] when it is absent, unreadable or made with other settings."""
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        batches = data["batches"]
        ok = data["settings"] == settings and all(
            isinstance(t, int) for b in batches for s in b["tokens"] for t in s)  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        log.warning("ignoring the unreadable or foreign self-text cache %s (it is sampled again)", path)
        return []
    return batches


def write_cache(path: Path, settings: dict, batches: list[dict]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"settings": settings, "batches": batches}), encoding="utf-8")
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()  # a part written to a full disk
    except OSError as e:  # a read-only home: the text is still used, only not kept
        log.warning("cannot cache the self-generated text in %s (%s): set MLA_CONVERT_CACHE", path.parent, e)
