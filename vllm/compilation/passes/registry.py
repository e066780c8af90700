"""The graph passes, one entry each: the PassConfig flag that switches it on, its place in the
order, and its class.

Adding a pass is one `PassEntry` here (plus its flag in `PassConfig`). Everything that
knows about passes reads this list: the pass manager builds the classes of the flags that
are on, in `order`; the config's start-up line ("passes: ...") lists the flags that are on
in the same order; the compile cache's key holds the manager's uuid, made of the passes it
built. An entry without a class is one of upstream's flags that this engine has no pass
for: accepted, and the manager warns when it is switched on.

No torch import here: the config reads this list before anything is compiled.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PassEntry:
    flag: str
    """The PassConfig field (bool) that switches the pass on."""
    order: int
    """Passes run in increasing `order` (ties: in list order)."""
    pass_class: str | None
    """"module:Class", imported only when the flag is on and built as `Class()` or
    `Class(vllm_config)`; None: no pass in this engine (the flag fuses nothing)."""
    fusion: bool = True
    """Listed on the manager's "Enabled fusions" line (the clean-up passes are not)."""


_PASSES = "vllm.compilation.passes"

# Order (upstream's): no-op elimination first (it exposes patterns), then the all-reduce
# fusion's place, RMSNorm+quant, SiluMul+quant, attention+quant. `PostCleanupPass` and then
# `FixFunctionalizationPass` always run after all of these (the manager adds them).
PASS_REGISTRY: list[PassEntry] = [
    PassEntry("eliminate_noops", 10, f"{_PASSES}.utility.noop_elimination:NoOpEliminationPass",
              fusion=False),
    PassEntry("fuse_allreduce_rms", 20,
              f"{_PASSES}.fusion.allreduce_rms_fusion:AllReduceFusionPass"),
    PassEntry("fuse_norm_quant", 30, f"{_PASSES}.fusion.rms_quant_fusion:RMSNormQuantFusionPass"),
    PassEntry("fuse_act_quant", 40,
              f"{_PASSES}.fusion.act_quant_fusion:ActivationQuantFusionPass"),
    PassEntry("fuse_attn_quant", 50, f"{_PASSES}.fusion.attn_quant_fusion:AttnQuantFusionPass"),
    # Upstream's flags this engine has no pass for (docs/upstream-differences.md).
    PassEntry("enable_qk_norm_rope_fusion", 60, None),
    PassEntry("enable_sp", 70, None),
    PassEntry("fuse_gemm_comms", 80, None),
    PassEntry("fuse_act_padding", 90, None),
    PassEntry("fuse_mla_dual_rms_norm", 100, None),
    PassEntry("fuse_rope_kvcache", 110, None),
    PassEntry("fuse_qk_norm_rope_kvcache", 120, None),
    PassEntry("fuse_rope_kvcache_cat_mla", 130, None),
]


def registered_passes() -> list[PassEntry]:
    """The entries in the order their passes run."""
    return sorted(PASS_REGISTRY, key=lambda entry: entry.order)


def enabled_entries(pass_config: object) -> list[PassEntry]:
    """The entries whose flag is on in `pass_config`, in run order."""
    return [e for e in registered_passes() if getattr(pass_config, e.flag, False)]


def has_pass(flag: str) -> bool:
    """Whether this engine has a pass for PassConfig `flag` (upstream's flags without an entry
    class are accepted and fuse nothing)."""
    return any(e.flag == flag and e.pass_class is not None for e in PASS_REGISTRY)
