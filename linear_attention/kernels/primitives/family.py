"""A kernel family's descriptor, and the one front of its entry points.

Every family with a `method` argument declares once, beside its entry point, a `Family`: its
methods (name → `Method`: the local kernel, the static options it takes, its forward FLOPs per
token, the Pallas backends it needs), its decode step and state type, and whether it splits
time over a mesh axis (`axis_name`). The entry point asks it to check the method (`check`:
the supported ones named when it is wrong, an old spelling warned and translated, a Pallas
method's backend and tile), whether the inputs go to float32 before the kernel (`float32`: a
Pallas kernel reads them in their own dtype and casts in VMEM) and for the kernel of the
method (`kernel`); layers read their FLOPs (`flops`) and choices (`methods`) from it, and
training whether a method needs a backend (`backends`).

The method words, one vocabulary across the families (docs/guides/kernels.md, "Methods"):

- "chunk": time in chunks (blocks) of `chunk_size` (`block_size`) tokens, dense work inside a
  chunk and a carry across chunks; every family's training path (old spelling: "blockwise");
- "scan": token by token, a `lax.scan` of the recurrence (old spelling: "recurrent");
- "quadratic": the whole [T, T] interaction at once, O(T²) memory: a reference;
- "exact": token by token with an exact solve where the other methods iterate (MesaNet's CG);
- "associative_scan", "chunk_parallel": a parallel prefix over tokens, over chunk summaries;
- "pallas": the chunk form as Pallas kernels, on the backends the method names.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from linear_attention.fields import check_choice, check_int
from linear_attention.kernels.primitives.pallas import CHUNK_MULTIPLE, pallas_target

# Old method words, each with its new spelling (accepted, with a `DeprecationWarning`).
OLD_WORDS: Mapping[str, str] = {"blockwise": "chunk", "recurrent": "scan"}


@dataclasses.dataclass(frozen=True)
class Method:
    """One method of a family: its local `kernel` (the family's own signature), the entry
    point's static options it takes by keyword (`static`, e.g. `("chunk_size",)`), `flops`
    (`flops(seq_len=, heads=, dk=, dv=, chunk_size=, **family_sizes)`: forward FLOPs per token)
    and the Pallas `backends` it compiles for (() for plain JAX, which runs on every backend)."""

    kernel: Callable
    flops: Callable[..., float]
    static: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Family:
    """A kernel family: `name` (its entry point), `methods` (name → `Method`, the default
    first), `step` (one token, for decoding; None: the family decodes from a cache of its own),
    `state` (the type of its recurrent state or cache), `splits_time` (whether `axis_name` is
    taken) and `old_words` (the old method spellings it still accepts)."""

    name: str
    methods: Mapping[str, Method]
    step: Callable | None = None
    state: type | None = None
    splits_time: bool = False
    old_words: tuple[str, ...] = ()

    @property
    def supported(self) -> tuple[str, ...]:
        """The method names, the default first."""
        return tuple(self.methods)

    def translate(self, method, what: str | None = None):
        """`method`, an old spelling of this family's translated to the new word with a
        `DeprecationWarning` naming it (`what`: who takes the method, for the message);
        anything else as it is."""
        if isinstance(method, str) and method in self.old_words:
            new = OLD_WORDS[method]
            warnings.warn(
                f"{what or self.name}: method {method!r} is now spelled {new!r}",
                DeprecationWarning,
                stacklevel=4,
            )
            return new
        return method

    def resolve(self, method, what: str | None = None) -> str:
        """`method` in the new vocabulary (`translate`); an unknown one raises a `ValueError`
        naming the supported methods."""
        method = self.translate(method, what)
        check_choice("method", method, self.supported)
        return method

    def backends(self, method: str) -> tuple[str, ...]:
        """The Pallas backends `method` needs (() where it runs on every backend)."""
        return self.methods[self.resolve(method)].backends

    def float32(self, method: str) -> bool:
        """Whether the inputs go to float32 before the kernel: every method but a Pallas one,
        whose kernels read them in their own dtype (a float32 copy made before the call is a
        temporary twice a bfloat16 input's size)."""
        return not self.methods[method].backends

    def check(self, method, chunk_size, size_name: str = "chunk_size") -> tuple[str, int]:
        """The front of an entry point: `(method, chunk_size)` checked (`resolve`; a positive
        `chunk_size`, named `size_name`; for a Pallas method, a backend it runs on here and a
        chunk that tiles)."""
        method = self.resolve(method)
        chunk_size = check_int(size_name, chunk_size)
        backends = self.methods[method].backends
        if backends:
            what = f'{self.name}(method="{method}")'
            backend, _ = pallas_target(what)
            if backend not in backends:
                others = [m for m, e in self.methods.items() if not e.backends]
                raise ValueError(
                    f"{what}: no Pallas {backend.upper()} kernel (its Pallas kernels: "
                    f"{', '.join(backends)}); use "
                    + " or ".join(f'method="{m}"' for m in others)
                    + ", or run the TPU kernels interpreted inside "
                    "linear_attention.kernels.pallas_interpret()"
                )
            if chunk_size % CHUNK_MULTIPLE:
                raise ValueError(
                    f"chunk_size must be a multiple of {CHUNK_MULTIPLE} for {what} (its blocks "
                    f"tile by {CHUNK_MULTIPLE} rows), got {chunk_size}"
                )
        return method, chunk_size

    def kernel(self, method: str, **options: Any) -> Callable:
        """The local kernel of a checked `method`, given the static options it takes."""
        entry = self.methods[method]
        return functools.partial(entry.kernel, **{name: options[name] for name in entry.static})

    def flops(self, method: str, **sizes: Any) -> float:
        """Forward FLOPs per token of `method` (`Method.flops`)."""
        return float(self.methods[self.resolve(method)].flops(**sizes))
