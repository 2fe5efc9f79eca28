"""The one place that knows a served layer's tensor shapes and byte counts (docs/FORMAT.md).

The builder lays base-plane and delta files out from it, the loader checks what it reads against it,
the verifier and plan count bytes with it. A layer is E experts of hidden size H and expert
intermediate size I; w13 is gate and up stacked ([E, 2I, H]), w2 is down ([E, H, I]).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import layout as L
from ..format.formats import E4M3_16, FORM_DTYPE, FORM_GROUP
from ..stwriter import TensorSpec


@dataclass(frozen=True)
class LayerGeometry:
    n_experts: int
    hidden_size: int
    intermediate_size: int
    w13_form: str = E4M3_16          # block-scale form of w13_weight_scale (formats.SCALE_FORMS)
    w2_form: str = E4M3_16
    input_scales: bool = True

    def base_specs(self) -> list[TensorSpec]:
        """The base-plane file's tensors, in file order."""
        E, H, I = self.n_experts, self.hidden_size, self.intermediate_size
        specs = [TensorSpec(L.W13_BASE, "U8", (E, 2 * I, H // 4)), TensorSpec(L.W2_BASE, "U8", (E, H, I // 4)),
                 TensorSpec(L.W13_SCALE, FORM_DTYPE[self.w13_form], (E, 2 * I, H // FORM_GROUP[self.w13_form])),
                 TensorSpec(L.W2_SCALE, FORM_DTYPE[self.w2_form], (E, H, I // FORM_GROUP[self.w2_form])),
                 TensorSpec(L.W13_SCALE_2, "F32", (E, 2)), TensorSpec(L.W2_SCALE_2, "F32", (E,))]
        if self.input_scales:
            specs += [TensorSpec(L.W13_INPUT_SCALE, "F32", (E, 2)), TensorSpec(L.W2_INPUT_SCALE, "F32", (E,))]
        specs += [TensorSpec(L.W13_TABLE, "F32", (E, 2, 4)), TensorSpec(L.W2_TABLE, "F32", (E, 4))]
        return specs

    def delta_specs(self, n: int | None = None) -> list[TensorSpec]:
        """The delta planes of `n` experts (all of them by default), w13 then w2."""
        E = self.n_experts if n is None else n
        H, I = self.hidden_size, self.intermediate_size
        return [TensorSpec(L.W13_DELTA, "U8", (E, 2 * I, H // 4)), TensorSpec(L.W2_DELTA, "U8", (E, H, I // 4))]

    def mid_specs(self, n: int | None = None) -> list[TensorSpec]:
        """The mid tier of `n` experts (all by default): mid planes (one bit a weight, rows packed
        separately, w13 then w2), then their 8-entry tables."""
        E = self.n_experts if n is None else n
        H, I = self.hidden_size, self.intermediate_size
        return [TensorSpec(L.W13_MID, "U8", (E, 2 * I, H // 8)), TensorSpec(L.W2_MID, "U8", (E, H, I // 8)),
                TensorSpec(L.W13_MID_TABLE, "F32", (E, 2, 8)), TensorSpec(L.W2_MID_TABLE, "F32", (E, 8))]

    def required_shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (dtype, shape) of what a loader must find in the base-plane file."""
        return {s.name: (s.dtype, s.shape) for s in self.base_specs()}

    @property
    def base_bytes(self) -> int:
        return sum(s.nbytes for s in self.base_specs())

    @property
    def expert_delta_bytes(self) -> int:
        """The delta planes of one expert (w13 + w2): a quarter byte a weight."""
        return sum(s.nbytes for s in self.delta_specs(1))

    @property
    def expert_mid_bytes(self) -> int:
        """The mid tier of one expert: its mid planes (an eighth byte a weight) and its three 8-entry tables."""
        return sum(s.nbytes for s in self.mid_specs(1))

    @property
    def weights(self) -> int:
        return self.n_experts * 3 * self.hidden_size * self.intermediate_size

    def rows(self, proj: str) -> slice:
        """The rows of a projection inside its fused tensor (w13: gate rows, then up rows)."""
        I = self.intermediate_size
        return slice(0, I) if proj == "gate_proj" else slice(I, 2 * I) if proj == "up_proj" else slice(None)

    def form(self, proj: str) -> str:
        return self.w2_form if proj == "down_proj" else self.w13_form


def is_w13(proj: str) -> bool:
    return proj != "down_proj"


def names_of(proj: str) -> tuple[str, str, str]:
    """(base, delta, block scale) tensor names of the fused tensor this projection belongs to."""
    return (L.W13_BASE, L.W13_DELTA, L.W13_SCALE) if is_w13(proj) else (L.W2_BASE, L.W2_DELTA, L.W2_SCALE)


__all__ = ["LayerGeometry", "is_w13", "names_of"]
