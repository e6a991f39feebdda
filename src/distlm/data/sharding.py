"""The data stage's plan: the corpus cut into shards, each a job of its own, and the tokenizer
they share; made from the config and a listing of the corpus (file sizes, parquet footers), never
from its contents, while the workflow builds its DAG.

    plan = plan_data(settings.data, settings.model)
    plan.tokenizer.id                 # results/data/tokenizers/<id>/
    [s.id for s in plan.shards]       # results/data/shards/<id>.h5, in the order of the streams

A split's records keep the corpus's order: its files in the order the config lists them (a glob's
in sorted order), each file's records in file order. A file larger than `data.shard_mb` is cut
(a .jsonl by byte range, a .parquet by row groups); consecutive small files share a shard. A
document of a source without a split of its own (the embedded corpus, train-only local files, a
hub data set without validation or test) is dealt to a split by a hash of its text
(distlm.data.sources.hash_split), so the plan of a grown corpus keeps every shard it had but the
last, and the split of every document.

A hub id's listing (its data files, their sizes and row groups, at the revision it resolves to)
asks the hub once, while the first DAG is built; it is kept in results/data/hub/, so later builds
and the jobs on other nodes read it instead (a local folder laid out like the hub is listed each
time). This module imports nothing heavy: the workflow imports it while it builds the DAG.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from distlm import DistlmError
from distlm.core.io import digest, read_json, write_json
from distlm.data.documents import (
    SPLITS,
    Carve,
    ShardSpec,
    Source,
    SplitName,
    TokenizerSpec,
    Unit,
)
from distlm.data.sources import EMBEDDED, expand, file_format, file_size, parquet_groups
from distlm.settings import DataSettings, ModelSourceSettings
from distlm.settings.data import DataHubSettings

MB = 1 << 20


@dataclass(frozen=True)
class DataPlan:
    """The tokenizer job and the shard jobs of one data config."""

    tokenizer: TokenizerSpec
    shards: tuple[ShardSpec, ...]


def data_digest(data: DataSettings, model: ModelSourceSettings) -> str:
    """The identity of a data config: what its token file's metadata records (config_digest),
    so a later stage can tell tokens made from another config."""
    tokenizer_from = model.model_dump() if model.source != "init" else None
    return digest({"data": data.model_dump(), "tokenizer_from": tokenizer_from})


# ----------------------------------------------------------------------------- files and units


@dataclass(frozen=True)
class Listed:
    """One corpus file as listed: where it is, its format, its bytes, and a .parquet's text bytes
    per row group."""

    file: str
    format: str
    size: int
    groups: tuple[int, ...] | None = None

    @classmethod
    def of(cls, path: str, text_field: str) -> Listed:
        fmt = file_format(path)
        groups = tuple(parquet_groups(path, text_field)) if fmt == "parquet" else None
        return cls(path, fmt, file_size(path), groups)


def file_units(f: Listed, shard_bytes: int) -> list[Unit]:
    """The units of one corpus file: a .jsonl cut into byte ranges of at most `shard_bytes`, a
    .parquet into runs of row groups of at most that much text (one group at least), a .txt
    whole."""
    if f.format == "txt":
        return [
            Unit(file=f.file, format="txt", size=f.size, start=0, stop=f.size, text_bytes=f.size)
        ]
    if f.format == "jsonl":
        n = max(1, math.ceil(f.size / shard_bytes))
        cuts = [f.size * k // n for k in range(n + 1)]
        return [
            Unit(file=f.file, format="jsonl", size=f.size, start=a, stop=b, text_bytes=b - a)
            for a, b in itertools.pairwise(cuts)
        ]
    groups = f.groups or ()
    runs: list[tuple[int, int, int]] = []  # (first group, end, text bytes)
    start, held = 0, 0
    for g, nbytes in enumerate(groups):
        if g > start and held + nbytes > shard_bytes:
            runs.append((start, g, held))
            start, held = g, 0
        held += nbytes
    runs.append((start, len(groups), held))
    return [
        Unit(file=f.file, format="parquet", size=f.size, start=a, stop=b, text_bytes=n)
        for a, b, n in runs
        if b > a or not groups
    ]


def pack(units: Iterable[Unit], shard_bytes: int) -> list[tuple[Unit, ...]]:
    """Consecutive units packed into shards of at most `shard_bytes` of text (a unit alone when
    it is larger)."""
    shards: list[list[Unit]] = []
    held = 0
    for u in units:
        if not shards or (held + u.text_bytes > shard_bytes and shards[-1]):
            shards.append([])
            held = 0
        shards[-1].append(u)
        held += u.text_bytes
    return [tuple(s) for s in shards]


# ----------------------------------------------------------------------------- roles


@dataclass(frozen=True)
class _Role:
    """The files of one role (the train files, or a held-out split's own) and where they go."""

    kind: str
    files: list[Listed]
    split: SplitName | None
    carve: Carve | None

    def source(self, units: Iterable[Unit], text_field: str) -> Source:
        return Source(
            kind=self.kind,  # pyright: ignore[reportArgumentType]
            units=tuple(units),
            split=self.split,
            carve=self.carve,
            text_field=text_field,
        )


def split_origins(data: DataSettings) -> dict[str, str]:
    """How each split is made: its own files, or carved out of train (and by which rule)."""
    if data.source == "embedded":
        return {
            "train": EMBEDDED,
            "validation": f"{data.validation_fraction:g} of {EMBEDDED}'s topics, by name hash",
            "test": f"{data.test_fraction:g} of {EMBEDDED}'s topics, by name hash",
        }
    out = {}
    for s in SPLITS:
        own = getattr(data.local, s) if data.source == "local" else getattr(data.hub.splits, s)
        if own:
            out[s] = (
                f"data.local.{s} {own}"
                if data.source == "local"
                else f"{_where(data)} split {own!r}"
            )
        else:
            fraction = data.validation_fraction if s == "validation" else data.test_fraction
            out[s] = f"carved out of train: {fraction:g} of its documents, by a hash of their text"
    return out


def _roles(data: DataSettings, files: dict[str, list[Listed]], kind: str) -> list[_Role]:
    """The roles of a corpus given its files per split (a split without files is carved out of
    train), the train role first."""
    carve_val, carve_test = not files["validation"], not files["test"]
    if carve_val or carve_test:
        carve = Carve(
            rule="hash",
            validation=data.validation_fraction if carve_val else 0.0,
            test=data.test_fraction if carve_test else 0.0,
        )
        roles = [_Role(kind, files["train"], None, carve)]
    else:
        roles = [_Role(kind, files["train"], "train", None)]
    for s in ("validation", "test"):
        if files[s]:
            roles.append(_Role(kind, files[s], s, None))  # pyright: ignore[reportArgumentType]
    return roles


def _embedded(data: DataSettings) -> Source:
    from distlm.data.sources import load_embedded

    text_bytes = sum(len(t.encode("utf-8")) for _, t in load_embedded())
    # named, not sized: the corpus is the Python's, part of the environment like the libraries
    unit = Unit(file=EMBEDDED, format="embedded", size=0, start=0, stop=0, text_bytes=text_bytes)
    carve = Carve(rule="name_rank", validation=data.validation_fraction, test=data.test_fraction)
    return Source(kind="embedded", units=(unit,), carve=carve, text_field=data.text_field)


def _sample(role: _Role, data: DataSettings, budget: int) -> tuple[Source, ...]:
    """The train role's files cut to their first `budget` bytes of text, whatever data.shard_mb
    is: what a BPE trains on (a .jsonl by bytes, a .parquet by whole row groups, a .txt whole)."""
    units: list[Unit] = []
    left = budget
    for f in role.files:
        if left <= 0:
            break
        if f.format == "parquet" and f.groups:
            n = next((i + 1 for i in range(len(f.groups)) if sum(f.groups[: i + 1]) >= left), None)
            f = Listed(f.file, f.format, f.size, f.groups[:n] if n else f.groups)
        (whole,) = file_units(f, max(f.size, sum(f.groups or ()), 1))
        if f.format == "jsonl" and whole.text_bytes > left:
            whole = whole.model_copy(update={"stop": left, "text_bytes": left})
        units.append(whole)
        left -= whole.text_bytes
    return (role.source(units, data.text_field),)


def plan_data(
    data: DataSettings, model: ModelSourceSettings, *, listings: Path | None = None
) -> DataPlan:
    """The plan of a data config (`listings`: where the hub ids' listings are kept)."""
    budget = max(1, int(data.tokenizer.sample_mb * MB))
    shard_bytes = max(1, int(data.shard_mb * MB))
    if data.source == "embedded":
        source = _embedded(data)
        shards, sample = [source], (source,)
    else:
        if data.source == "local":
            paths = {s: expand(getattr(data.local, s), f"data.local.{s}") for s in SPLITS}
            if not paths["train"]:
                raise DistlmError("data.local.train: at least one file is required")
            files = {s: [Listed.of(p, data.text_field) for p in ps] for s, ps in paths.items()}
            roles = _roles(data, files, "local")
        else:
            roles = _roles(data, hub_files(data, listings), "hub")
        shards = [
            role.source(packed, data.text_field)
            for role in roles
            for packed in pack(
                (u for f in role.files for u in file_units(f, shard_bytes)), shard_bytes
            )
        ]
        sample = _sample(roles[0], data, budget)
    tok = data.tokenizer
    if model.source != "init":
        spec = TokenizerSpec(
            kind="model",
            model=model.model_dump(include={"source", "name", "revision"}),
            vocab_size=0,
            min_frequency=0,
        )
    elif tok.name is not None:
        spec = TokenizerSpec(
            kind="named", name=tok.name, vocab_size=tok.vocab_size, min_frequency=0
        )
    else:
        spec = TokenizerSpec(
            kind="trained",
            vocab_size=tok.vocab_size,
            min_frequency=tok.min_frequency,
            sample=sample,
            sample_bytes=budget,
        )
    specs = tuple(
        ShardSpec(source=source, separator=data.separator, tokenizer=spec.id) for source in shards
    )
    return DataPlan(tokenizer=spec, shards=specs)


# ----------------------------------------------------------------------------- hub data sets


class Unlisted(DistlmError):
    """A hub data set that cannot be listed here (no network, no cached copy)."""


def _where(data: DataSettings) -> str:
    hub = data.hub
    return f"data.hub {hub.path!r}" + (f" / {hub.name!r}" if hub.name else "")


def listing_key(hub: DataHubSettings, text_field: str) -> str:
    """The file name (without .json) of a hub id's listing."""
    key = {"path": hub.path, "name": hub.name, "revision": hub.revision, "text": text_field}
    return digest(key)[:16]


def hub_files(data: DataSettings, listings: Path | None) -> dict[str, list[Listed]]:
    """The data files of each split of a hub data set (or a local folder laid out like one), as
    `datasets` resolves its configs; a split named null has none (it is carved out of train). A
    hub id's listing is read from `listings` when it was made before, else made and kept there."""
    hub = data.hub
    where = _where(data)
    if Path(hub.path).is_dir():
        listing = list_hub(hub, data.text_field)
    else:
        kept = (listings or Path(".")) / f"{listing_key(hub, data.text_field)}.json"
        if kept.is_file():
            listing = read_json(kept, "hub listing")
        else:
            listing = list_hub(hub, data.text_field)
            if listings is not None:
                write_json(kept, listing)
    out: dict[str, list[Listed]] = {}
    for s in SPLITS:
        name = getattr(hub.splits, s)
        if name is None:
            out[s] = []
            continue
        if name not in listing:
            raise DistlmError(
                f"{where}: no split {name!r} (data.hub.splits.{s}); has {sorted(listing)}"
            )
        out[s] = [
            Listed(f["file"], f["format"], f["size"], tuple(f["groups"]) if f["groups"] else None)
            for f in listing[name]
        ]
    return out


def list_hub(hub: DataHubSettings, text_field: str) -> dict[str, list[dict]]:
    """Split -> its data files (file, format, size, a parquet's text bytes per row group), as
    `datasets` resolves the data set's config. A local folder's files are named under the folder
    as the config names it (`datasets` gives absolute paths), so a moved project with its corpus
    inside plans the same shards."""
    where = f"data.hub {hub.path!r}" + (f" / {hub.name!r}" if hub.name else "")
    try:
        import datasets

        builder = datasets.load_dataset_builder(hub.path, hub.name, revision=hub.revision)
    except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
        raise Unlisted(
            f"{where}: could not load the dataset ({type(e).__name__}: {e}). Offline? Set "
            "HF_DATASETS_OFFLINE=1 with a cached copy, or use data.source local"
        ) from None
    files = builder.config.data_files
    if not files:
        raise DistlmError(
            f"{where}: the data set lists no data files (a data set built by a loading script "
            "cannot be sharded: use its parquet conversion, or data.source local)"
        )
    local = Path(hub.path).is_dir()
    out = {}
    for split, paths in files.items():
        listed = []
        for p in map(str, paths):
            f = Listed.of(p, text_field)
            name = _under(p, hub.path) if local else p
            listed.append({"file": name, "format": f.format, "size": f.size, "groups": f.groups})
        out[str(split)] = listed
    return out


def _under(path: str, folder: str) -> str:
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(folder))
    return path if rel.startswith("..") else os.path.join(folder, rel)


# ----------------------------------------------------------------------------- the workflow's view


@dataclass(frozen=True)
class Layout:
    """Where the data stage's jobs write (results/data/..., shared by every run of a sweep: a
    shard's, tokenizer's or listing's path is its identity)."""

    shards: str  # results/data/shards
    tokenizers: str  # results/data/tokenizers
    listings: str  # results/data/hub: the hub ids' listings

    def shard(self, shard_id: str) -> str:
        return f"{self.shards}/{shard_id}.h5"

    def tokenizer(self, tokenizer_id: str) -> str:
        return f"{self.tokenizers}/{tokenizer_id}"

    def tokenizer_info(self, tokenizer_id: str) -> str:
        return f"{self.tokenizers}/{tokenizer_id}.json"


class DataPlans:
    """The data stage as the workflow sees it while it builds the DAG: each run's plan (by its
    data config), the inputs of its gather, and the spec of each job by id.

    A gather's inputs are its plan's tokenizer and shards, except where the work is finished and
    the corpus is not needed to know it:
    - a token file of the release before (one file, version 1) made from this very config is the
      data: the gather has no input, so a results folder of that release reruns nothing;
    - a corpus that cannot be listed any more (a file freed once tokenized) with a finished index
      of this config: the index's own shards, and a warning (`notes`) that the work is kept;
    - in a dry run (`dry_run()` true), a hub data set that cannot be listed here (a machine with
      no network): no inputs, and a warning that its tokenizer and shard jobs are planned once it
      can be listed. A real run stops there, naming data.hub.
    """

    def __init__(self, layout: Layout, every_settings, dry_run=lambda: False) -> None:
        self.layout = layout
        self._every = every_settings  # () -> the settings of every run, to find a job's spec
        self._dry_run = dry_run
        self._plans: dict[str, tuple[str, tuple[ShardSpec, ...]] | None] = {}
        self.shards: dict[str, ShardSpec] = {}
        self.tokenizers: dict[str, TokenizerSpec] = {}
        self.notes: list[str] = []

    def _plan(self, data: DataSettings, model: ModelSourceSettings, tokens: str):
        key = digest([data_digest(data, model), tokens])
        if key not in self._plans:
            try:
                plan = plan_data(data, model, listings=Path(self.layout.listings))
            except DistlmError as e:
                from distlm.data.tokens import finished_shards

                kept = finished_shards(tokens, data_digest(data, model)) if tokens else None
                if kept is not None:
                    self.notes.append(
                        f"{e}; the finished token file {tokens} of this config is kept (its "
                        "shards are there): the corpus is needed only to tokenize it again"
                    )
                    self._plans[key] = (kept[0], tuple(kept[1]))
                elif isinstance(e, Unlisted) and self._dry_run():
                    self.notes.append(
                        f"{e}. This dry run plans the data stage's gather alone: its tokenizer "
                        "and shard jobs are planned once the data set can be listed"
                    )
                    self._plans[key] = None
                else:
                    raise
            else:
                self.tokenizers[plan.tokenizer.id] = plan.tokenizer
                self._plans[key] = (plan.tokenizer.id, plan.shards)
            planned = self._plans[key]
            if planned is not None:
                self.shards.update({s.id: s for s in planned[1]})
        return self._plans[key]

    def inputs(
        self, data: DataSettings, model: ModelSourceSettings, *, tokens: str, stats: str
    ) -> dict[str, str | list[str]]:
        """The gather's inputs: {"tokenizer": folder, "tokenizer_info": its TokenizerInfo,
        "shards": [files]}, or none (above)."""
        from distlm.data.tokens import finished_v1

        if Path(stats).is_file() and finished_v1(tokens, data_digest(data, model)):
            return {}
        planned = self._plan(data, model, tokens)
        if planned is None:
            return {}
        tok, shards = planned
        return {
            "tokenizer": self.layout.tokenizer(tok),
            "tokenizer_info": self.layout.tokenizer_info(tok),
            "shards": [self.layout.shard(s.id) for s in shards],
        }

    def _find(self, table: dict, key: str, what: str):
        for s in self._every() if key not in table else ():
            with contextlib.suppress(DistlmError):
                self._plan(s.data, s.model, "")
        if key not in table:
            raise DistlmError(f"{what} {key} is in no run's plan of this config")
        return table[key]

    def shard(self, shard_id: str) -> ShardSpec:
        return self._find(self.shards, shard_id, "shard")

    def tokenizer(self, tokenizer_id: str) -> TokenizerSpec:
        return self._find(self.tokenizers, tokenizer_id, "tokenizer")
