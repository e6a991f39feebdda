"""A family's tensors, declared once, without torch: each of distlm's parameters, the
transformers tensors it is, and its shape. Everything else about them is derived from the one
declaration (`TensorTable`):

    table.rules(args)            # the map between distlm's names and transformers' (TensorMap)
    table.shapes(args, cut)      # distlm's parameters of a model (or a pipeline stage): shapes
    table.parameters(args)       # how many parameters the model has (a tied head once)
    table.block_parameters(args) # ... one of its blocks (what a sharded layout gathers at once)
    table.layer_of(hf_name)      # the pipeline cut: a checkpoint tensor's decoder layer,
    table.is_first / is_last     # or its place on the first or the last stage

A parameter's place follows from its name in distlm's model (`distlm.family.transformer`):
`embedding.*` is the first stage's, `layers.{i}.*` decoder block i's, `norm.*` and `lm_head.*`
the last stage's. A test builds each family's model and checks it holds exactly the table's
parameters, in the table's shapes, for every variant of its args.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from distlm import DistlmError

Shape = Callable[[Any], tuple[int, ...]]  # a family's ModelArgs -> a shape
Dim = Callable[[Any], int]  # a family's ModelArgs -> a dimension

HEAD = "lm_head.weight"  # distlm's and transformers' name of the LM head's weight


@dataclass(frozen=True)
class Cut:
    """What one model holds of a family's decoder: blocks [start, end), the embeddings when
    `first`, the final norm and the LM head when `last`. The whole model is `Cut.whole(args)`;
    a pipeline stage is the cut its shard entry names (`ShardEntry.cut`)."""

    start: int
    end: int
    first: bool = True
    last: bool = True

    @classmethod
    def whole(cls, n_layers: int) -> Cut:
        return cls(0, n_layers)

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    @property
    def both_ends(self) -> bool:
        """Embeddings and head in one model: a tied head is the embedding itself."""
        return self.first and self.last

    def check(self, n_layers: int) -> Cut:
        if not 0 <= self.start < self.end <= n_layers:
            raise DistlmError(f"blocks [{self.start}, {self.end}) of a model of {n_layers}")
        return self


@dataclass(frozen=True)
class Rule:
    """One of distlm's tensors and the transformers tensors it is: the same (`same`), transposed
    (`t`: transformers' Conv1D holds a linear layer's weight as (in, out)), or theirs
    concatenated along the first dimension (`cat`, of `sizes` rows each: fused projections).
    Names may hold `{i}`, a block's index."""

    ours: str
    hf: tuple[str, ...]
    kind: Literal["same", "t", "cat"] = "same"
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Param:
    """One of distlm's parameters in a family's table (`{i}` in names: a block's index)."""

    ours: str  # its name in distlm's model
    hf: tuple[str, ...]  # the transformers tensors it is (several: a fused projection)
    shape: Shape  # its shape in distlm's model
    kind: Literal["same", "t", "cat"] = "same"
    sizes: Shape | None = None  # cat: the rows of each of `hf`
    when: Callable[[Any], bool] | None = None  # present only when (a bias, a norm of a variant)

    def present(self, args: Any) -> bool:
        return self.when is None or bool(self.when(args))

    @property
    def place(self) -> Literal["first", "block", "last"]:
        if self.ours.startswith("embedding."):
            return "first"
        if self.ours.startswith("layers.{i}."):
            return "block"
        if self.ours.startswith(("norm.", "lm_head.")):
            return "last"
        raise DistlmError(f"table parameter {self.ours!r}: not an embedding, block or head name")


def linear(
    ours: str,
    hf: str | tuple[str, ...],
    out: Dim,
    inp: Dim,
    *,
    bias: Callable[[Any], bool] | bool = True,
    kind: Literal["same", "t", "cat"] = "same",
    sizes: Shape | None = None,
) -> tuple[Param, ...]:
    """A linear layer's weight (out, in) and, when it has one, its bias (out,): `ours` and `hf`
    name the layer (".weight" and ".bias" are added)."""
    names = (hf,) if isinstance(hf, str) else hf
    weight = Param(
        f"{ours}.weight",
        tuple(f"{h}.weight" for h in names),
        lambda a: (out(a), inp(a)),
        kind,
        sizes,
    )
    if bias is False:
        return (weight,)
    return (
        weight,
        Param(
            f"{ours}.bias",
            tuple(f"{h}.bias" for h in names),
            lambda a: (out(a),),
            "cat" if kind == "cat" else "same",
            sizes,
            None if bias is True else bias,  # a bias the args may leave out
        ),
    )


def norm(
    ours: str,
    hf: str,
    width: Dim,
    *,
    bias: bool = False,
    when: Callable[[Any], bool] | None = None,
) -> tuple[Param, ...]:
    """A norm's weight (and bias) of width `width`: `ours` and `hf` name the norm."""
    names = ("weight", "bias") if bias else ("weight",)
    return tuple(
        Param(f"{ours}.{n}", (f"{hf}.{n}",), lambda a: (width(a),), when=when) for n in names
    )


def embedding(ours: str, hf: str, rows: Dim) -> Param:
    """A lookup table's weight (rows, the model's width)."""
    return Param(ours, (hf,), lambda a: (rows(a), a.dim))


# the LM head's weight (vocabulary, width), under transformers' name: every family's
LM_HEAD = Param(HEAD, (HEAD,), lambda a: (a.vocab_size, a.dim))


class TensorTable:
    """A family's parameters (`Param`s) and what is derived from them (see the module doc).
    `embedding` is distlm's name of the input embedding's weight (what a tied head is)."""

    def __init__(self, params: Iterable[Param | tuple[Param, ...]], *, embedding: str) -> None:
        flat: list[Param] = []
        for p in params:
            flat += p if isinstance(p, tuple) else (p,)
        self.params: tuple[Param, ...] = tuple(flat)
        ours = [p.ours for p in self.params]
        if len(set(ours)) != len(ours) or embedding not in ours or HEAD not in ours:
            raise DistlmError("a tensor table names each parameter once, the embedding and head")
        prefixes = {h.split("{i}")[0] for p in self.params if p.place == "block" for h in p.hf}
        if len(prefixes) != 1:
            raise DistlmError(f"a tensor table's blocks share one prefix, not {sorted(prefixes)}")
        self.layers = prefixes.pop()  # transformers' prefix of decoder layer i's tensors
        self._by_ours = {p.ours: p for p in self.params}
        self.embedding = self._by_ours[embedding].hf[0]  # transformers' name of the embedding
        self.embedding_param = embedding  # distlm's
        self.head = self._by_ours[HEAD].hf[0]
        self._first = {h for p in self.params if p.place == "first" for h in p.hf}
        self._last = {h for p in self.params if p.place == "last" for h in p.hf}

    # -- the pipeline cut: a transformers tensor's place ----------------------------------------
    def layer_of(self, name: str) -> int | None:
        """The decoder layer a tensor belongs to; None for embeddings, final norm and head."""
        if not name.startswith(self.layers):
            return None
        index = name[len(self.layers) :].split(".", 1)[0]
        return int(index) if index.isdigit() else None

    def is_first(self, name: str) -> bool:
        """An embedding tensor: held by stage 0."""
        return name in self._first

    def is_last(self, name: str) -> bool:
        """Final norm or LM head: held by the last stage."""
        return name in self._last

    # -- derived from the declaration ------------------------------------------------------------
    def rules(self, args: Any) -> list[Rule]:
        """The map between distlm's names and transformers' for a model of `args`."""
        return [
            Rule(p.ours, p.hf, p.kind, p.sizes(args) if p.sizes else ())
            for p in self.params
            if p.present(args)
        ]

    def shapes(self, args: Any, cut: Cut | None = None) -> dict[str, tuple[int, ...]]:
        """distlm's parameters of a model of `args` cut at `cut` (default: whole), in its
        order, with their shapes (a tied head is the embedding: not counted apart)."""
        cut = cut or Cut.whole(args.n_layers)
        held = [p for p in self.params if p.present(args)]
        out: dict[str, tuple[int, ...]] = {}
        if cut.first:
            out.update((p.ours, p.shape(args)) for p in held if p.place == "first")
        for i in cut.layers:
            out.update((p.ours.format(i=i), p.shape(args)) for p in held if p.place == "block")
        if cut.last:
            tied = args.tied and cut.both_ends  # the head is the embedding
            out.update(
                (p.ours, p.shape(args))
                for p in held
                if p.place == "last" and not (tied and p.ours == HEAD)
            )
        return out

    def block_parameters(self, args: Any) -> int:
        """How many parameters one decoder block has (every block has as many)."""
        return sum(
            _numel(p.shape(args)) for p in self.params if p.place == "block" and p.present(args)
        )

    def parameters(self, args: Any) -> int:
        """How many parameters the whole model has (a tied head counted once)."""
        return sum(_numel(s) for s in self.shapes(args).values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
