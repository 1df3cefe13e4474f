"""``cp_method: auto``: the chooser on model profiles (pure: no launch, no model weights), the config rules
that accept ``auto`` before the model is known, and its resolution once the profile is.

The chooser reads every method's own checks, so these tests judge its picks against those checks (never
against a table of their own): whatever a method computes after another change, ``auto`` must pick one
that computes the model, the cheapest by the methods' exchange terms, and refuse only when none does.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest

from automodel.distributed.cp import (
    CPMethod,
    check_model_config_for_cp,
    choose_cp_method,
    cp_methods,
    get_cp_method,
    register_cp_method,
    unregister_cp_method,
)
from automodel.distributed.cp.choose import Candidate
from automodel.distributed.cp.method import ExchangeTerm, profile_problems, standard_problem
from automodel.distributed.cp.profile import LayerSpec, ModelProfile
from automodel.errors import CPUnsupportedError

FULL = LayerSpec(0, "full_attention")


def _profile(*layers: LayerSpec, heads: int = 32, kv: int = 8, attn: str = "sdpa", vlm: bool = False) -> ModelProfile:
    layers = tuple(dataclasses.replace(layer, index=i) for i, layer in enumerate(layers))
    return ModelProfile("llama", "LlamaForCausalLM", layers or (FULL,), heads, kv, 128, vlm, attn, True,
                        hidden_size=heads * 128)  # fmt: skip


PROFILES = {
    "dense": _profile(FULL, FULL),
    "sliding": _profile(LayerSpec(0, "sliding_window", window=16), FULL),
    "sinks_eager": _profile(LayerSpec(0, "sliding_window", window=16, sinks=True), FULL, attn="eager"),
    "softcap_eager": _profile(LayerSpec(0, "full_attention", softcap=50.0), FULL, attn="eager"),
    "gated_deltanet": _profile(LayerSpec(0, "linear_mixer", mixer="Qwen3NextGatedDeltaNet"), FULL),
    "heads_6": _profile(FULL, heads=6, kv=2),
    "heads_3": _profile(FULL, heads=3, kv=1),
    "vlm": _profile(FULL, vlm=True),
    "unknown_mixer": _profile(LayerSpec(0, "unknown", mixer="DogeAttention"), FULL),
}


def _computes(m: CPMethod, profile: ModelProfile, cp: int, seq: int, packed: bool) -> bool:
    """The registry's own answer: ``m`` runs the model exactly (the checks context_parallel runs)."""
    if packed and not m.supports_packed:
        return False
    try:
        check_model_config_for_cp(m, profile, cp, seq_len=seq)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", PROFILES)
def test_picks_a_method_that_computes_the_model_and_the_cheapest_of_them(name):
    profile = PROFILES[name]
    for cp, packed, node in itertools.product((2, 4, 8), (False, True), (None, 4)):
        configs = [(m, o) for method in cp_methods().values() for m, o in method.auto_configs(cp, node)]
        running = [m for m, _ in configs if _computes(m, profile, cp, 4096, packed)]
        where = f"{name} cp={cp} packed={packed} node={node}"
        if not running:
            with pytest.raises(CPUnsupportedError) as info:
                choose_cp_method(profile, cp, seq_len=4096, packed=packed, ranks_per_node=node)
            for method in cp_methods():  # every method's reason is in the one message
                assert f"{method}" in str(info.value), (where, str(info.value))
            continue
        choice = choose_cp_method(profile, cp, seq_len=4096, packed=packed, ranks_per_node=node)
        assert _computes(choice.method, profile, cp, 4096, packed), where
        assert choice.reason.startswith(f"cp_method auto: {choice.name}") and "\n" not in choice.reason, where
        best = next(c for c in choice.candidates if c.method is choice.method)
        assert all(c.cost >= best.cost for c in choice.candidates if c.computes), where
        for c in choice.candidates:  # a candidate is refused exactly when the registry's checks refuse it
            assert c.computes == _computes(c.method, profile, cp, 4096, packed), (where, c.label, c.problems)


def test_packed_rows_never_go_to_a_method_that_attends_across_the_row():
    for profile in PROFILES.values():
        try:
            choice = choose_cp_method(profile, 2, seq_len=512, packed=True)
        except CPUnsupportedError:
            continue
        assert choice.method.supports_packed
    ring = next(c for c in choose_cp_method(PROFILES["dense"], 2, seq_len=512, packed=True).candidates
                if c.name == "ring")  # fmt: skip
    assert ring.problems == ("packed rows (several documents per row): ring attends across the whole row",)


def test_dense_model_packed_goes_to_thd_docs_unpacked_inside_a_node_to_ulysses_across_nodes_to_usp():
    """The cost ranking of the module docstring, on a 32-head GQA model with rows of 32K tokens."""
    dense = PROFILES["dense"]
    assert choose_cp_method(dense, 8, seq_len=32768, packed=True).name == "thd_docs"
    assert choose_cp_method(dense, 8, seq_len=32768).name == "ulysses"  # all-to-all does not grow with cp
    across = choose_cp_method(dense, 8, seq_len=32768, ranks_per_node=4)
    assert across.name == "usp" and across.options == {"ulysses_size": 4}  # all-to-all inside each node
    assert across.method.ulysses_size == 4 and "usp (ulysses_size=4)" in across.reason


def test_heads_that_do_not_divide_cp_size_rule_out_the_head_split_only():
    choice = choose_cp_method(PROFILES["heads_6"], 4, seq_len=32768)
    assert choice.name != "ulysses"
    ulysses = next(c for c in choice.candidates if c.name == "ulysses")
    assert "num_attention_heads=6" in ulysses.problems[0] and "not divisible by distributed.cp_size=4" in ulysses.problems[0]
    usp = [c for c in choice.candidates if c.name == "usp"]
    assert usp and usp[0].options == {"ulysses_size": 2} and usp[0].computes  # 6 heads split over 2


def test_refuses_with_every_methods_reason_when_none_computes():
    with pytest.raises(CPUnsupportedError) as info:
        choose_cp_method(PROFILES["unknown_mixer"], 2, seq_len=64)
    msg = str(info.value)
    assert msg.startswith("distributed.cp_method=auto found no CP method that computes LlamaForCausalLM")
    for name in cp_methods():
        assert f"{name}: " in msg, name  # "<method>: <its reasons>" (usp: no configuration at cp_size=2)
    assert "DogeAttention" in msg and "distributed.cp_size=1" in msg and "docs/support_matrix.md" in msg


def test_row_length_not_known_judges_windows_against_any_length():
    """The own loop may not give seq_len: a window is then shorter than the row for every method, never left to
    the first attention call (thd_docs would refuse there, after auto had picked it)."""
    sliding = PROFILES["sliding"]
    choice = choose_cp_method(sliding, 2)
    assert not profile_problems(choice.method, sliding, 1 << 40)
    for c in choice.candidates:  # a method that would judge the window at the call counts only if it computes it
        assert c.computes == (not profile_problems(c.method, sliding, 1 << 40)), c.label
        assert "1099511627776" not in " ".join(c.problems), c.problems
        assert all("shorter than rows of any length" in p for p in c.problems if "sliding-window" in p), c.problems
    assert choose_cp_method(sliding, 2, seq_len=16).name == "thd_docs"  # a window as long as the row is full


def test_cp_size_1_picks_what_cp_size_2_would():
    for packed in (False, True):
        one = choose_cp_method(PROFILES["dense"], 1, seq_len=512, packed=packed)
        assert one.name == choose_cp_method(PROFILES["dense"], 2, seq_len=512, packed=packed).name
        assert "cp_size 1: no context parallelism" in one.reason
    assert choose_cp_method(PROFILES["unknown_mixer"], 1, seq_len=64).name == next(iter(cp_methods()))


class _Toy(CPMethod):
    """A registered method the built-ins do not know: auto reads it through the registry like the others."""

    name = "toy_everything"
    summary = "computes every layer, at a huge cost"
    supports_packed = True

    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        return None

    def exchange_terms(self, d, r, packed: bool = False) -> list[ExchangeTerm]:
        return [ExchangeTerm("everything", r.cp, r.cp, 1e30, 1)]


class _Cheap(_Toy):
    name = "toy_cheap_but_refusing"

    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        return standard_problem(self.name, layer, seq_len)  # full attention only

    def exchange_terms(self, d, r, packed: bool = False) -> list[ExchangeTerm]:
        return []


def test_a_newly_registered_method_is_chosen_when_it_alone_computes_and_a_cheap_refusing_one_never():
    register_cp_method(_Toy())
    register_cp_method(_Cheap())
    try:
        choice = choose_cp_method(PROFILES["unknown_mixer"], 2, seq_len=64)
        assert choice.name == "toy_everything"  # the only one computing: never refused while it computes
        assert "refused: " in choice.reason and "toy_cheap_but_refusing (" in choice.reason
        dense = choose_cp_method(PROFILES["dense"], 2, seq_len=64)
        assert dense.name == "toy_cheap_but_refusing"  # computes a dense model and costs nothing
    finally:
        unregister_cp_method("toy_everything")
        unregister_cp_method("toy_cheap_but_refusing")


def test_extra_problems_rule_a_method_out_with_their_reason():
    seen: list[Candidate] = []

    def no_ulysses(m: CPMethod, options: dict) -> list[str]:
        return ["distributed.x=1 is refused by ulysses here"] if m.name == "ulysses" else []

    choice = choose_cp_method(PROFILES["dense"], 8, seq_len=32768, extra_problems=no_ulysses)
    assert choice.name != "ulysses"
    seen = [c for c in choice.candidates if c.name == "ulysses"]
    assert seen[0].problems == ("distributed.x=1 is refused by ulysses here",)
    assert "ulysses (distributed.x=1 is refused by ulysses here)" in choice.reason


def test_auto_is_reserved_and_get_cp_method_says_how_to_resolve_it():
    with pytest.raises(ValueError, match="names no method until the model is known"):
        get_cp_method("auto")

    class Auto(_Toy):
        name = "auto"

    with pytest.raises(ValueError, match="reserves for choosing a method"):
        register_cp_method(Auto())


# ------------------------------------------------------------------ the config and its resolution


def test_config_accepts_auto_and_resolves_it_once_the_profile_is_known():
    from automodel.config import ConfigError, load_config
    from automodel.config.cp_auto import resolve_cp_method
    from automodel.config.rules import check_rules, config_with_method

    cfg = load_config(["--config", "configs/cp.yaml", "distributed.cp_method=auto"], world_size=2).cfg
    assert cfg.distributed.cp_method == "auto"
    choice = resolve_cp_method(cfg, _profile(FULL, heads=4, kv=2), world_size=2, cuda_available=False)
    assert cfg.distributed.cp_method == choice.name and choice.name in cp_methods()
    assert resolve_cp_method(cfg, _profile(FULL), world_size=2) is None  # a named method stays
    with pytest.raises(ConfigError, match=r"'rng' is not one of .* or 'auto'"):
        load_config(["--config", "configs/cp.yaml", "distributed.cp_method=rng"], world_size=2)
    # the config rules of each method still apply: rows padded to 2 rule out the head-tail split of 2 * cp_size
    cfg = load_config(["--config", "configs/cp.yaml", "distributed.cp_method=auto", "data.pad_to_multiple_of=2"],
                      world_size=2).cfg  # fmt: skip
    before = copy.deepcopy(cfg)
    choice = resolve_cp_method(cfg, _profile(FULL, heads=4, kv=2), world_size=2, cuda_available=False)
    ring = next(c for c in choice.candidates if c.name == "ring")
    assert choice.name != "ring" and any("data.pad_to_multiple_of=2 is not a multiple of" in p for p in ring.problems)
    for c in choice.candidates:  # exactly the rules of the config with that method selected
        rules = check_rules(config_with_method(before, c.name, c.options), 2, False)
        assert set(rules) <= set(c.problems), (c.label, rules, c.problems)


def test_config_with_auto_that_no_method_can_run_is_one_error_naming_each_method(monkeypatch):
    from automodel.config import ConfigError, load_config, rules

    real = rules.check_rules

    def refuse_all_but_auto(cfg, world, cuda_available=None, **kw):
        found = real(cfg, world, cuda_available, **kw)
        return found if cfg.distributed.cp_method == "auto" else found + [f"test: {cfg.distributed.cp_method} refused"]

    monkeypatch.setattr(rules, "check_rules", refuse_all_but_auto)  # what method_rules calls per method
    with pytest.raises(ConfigError) as info:
        load_config(["--config", "configs/cp.yaml", "distributed.cp_method=auto"], world_size=2)
    (text,) = info.value.problems if hasattr(info.value, "problems") else (str(info.value),)
    assert "distributed.cp_method=auto found no CP method this config can run. " in text
    for name in ("ring", "ulysses", "thd", "thd_docs"):
        assert f"{name}: test: {name} refused" in text
    assert "usp: no configuration at cp_size=2" in text


def test_method_line_gives_autos_reason_or_compares_a_named_method_with_autos_pick():
    from automodel.distributed.cp.choose import method_line

    dense = PROFILES["dense"]
    auto = choose_cp_method(dense, 8, seq_len=32768)  # ulysses (test above)
    assert method_line("ulysses", 8, auto) == auto.reason  # the config said auto: its reason
    assert method_line("ulysses", 8, None, auto) == "cp_method ulysses: named in the config; cp_method auto picks the same"
    ring = method_line("ring", 8, None, auto)
    assert ring.startswith("cp_method ring: named in the config; cp_method auto would pick ulysses (ring ")
    ring_cost = next(c.cost for c in auto.candidates if c.name == "ring")
    ulysses_cost = next(c.cost for c in auto.candidates if c.name == "ulysses")
    assert ring_cost > ulysses_cost and "sent per rank per attention layer" in ring
    across = choose_cp_method(dense, 8, seq_len=32768, ranks_per_node=4)  # usp (ulysses_size=4)
    assert method_line("usp", 8, None, across, {"ulysses_size": 4}).endswith("cp_method auto picks the same")
    assert "usp (ulysses_size=2) " in method_line("usp", 8, None, across, {"ulysses_size": 2})
    assert method_line("thd", 1, None, None) == "cp_method thd: named in the config (cp_size 1: no context parallelism)"
    assert method_line("thd", 2, None, None) == "cp_method thd: named in the config"


def test_auto_ranks_by_the_one_cost_model_inside_and_across_nodes():
    """auto's cost is exchange_cost's (the declaration the step estimate reads): bytes inside a node plus
    INTER_NODE_WEIGHT x bytes across; its reason names the bytes sent, the across-node part apart."""
    from automodel.distributed.cp import exchange_cost
    from automodel.distributed.cp.cost import INTER_NODE_WEIGHT

    dense = PROFILES["dense"]  # 32 heads, 8 KV heads of 128
    choice = choose_cp_method(dense, 8, seq_len=32768, ranks_per_node=4)
    for c in choice.candidates:
        if c.computes:
            e = exchange_cost(c.method, dense, seq_len=32768, cp_size=8, ranks_per_node=4)
            assert c.cost == e.weighted_bytes == e.intra_node_bytes + INTER_NODE_WEIGHT * e.inter_node_bytes, c.label
            assert c.terms == e.terms
    usp = next(c for c in choice.candidates if c.label == "usp (ulysses_size=4)")
    (a2a, a2a_across), (gather, gather_across) = usp.exchange.items()
    assert not a2a_across and gather_across  # the all-to-all inside a node of 4, the ring sub-group strided across
    n, kv = 4096, 8 * 128  # tokens per rank; KV heads x head_dim
    assert a2a.forward_bytes == a2a.backward_bytes == 3 / 4 * n * (2 * 32 * 128 + 2 * kv) * 2
    assert (gather.forward_bytes, gather.backward_bytes) == (n * 2 * kv * 2, 2 * n * 2 * kv * 2)
    assert "usp (ulysses_size=4), the cheapest" in choice.reason
    assert "168.00 MiB (48.00 MiB of it across nodes) sent per rank per attention layer" in choice.reason
    ring = next(c for c in choice.candidates if c.name == "ring").exchange
    assert ring.intra_node_bytes == 0 and ring.inter_node_bytes == 3 * 7 * n * 2 * kv * 2
    # one node: nothing crosses; TP spreads a CP group over cp x tp consecutive ranks
    assert not exchange_cost(get_cp_method("ring"), dense, seq_len=32768, cp_size=8).inter_node_bytes
    spread = exchange_cost(get_cp_method("ring"), dense, seq_len=32768, cp_size=4, tp_size=2, ranks_per_node=4)
    assert spread.inter_node_bytes == spread.total_bytes > 0
    # options bound by name: the methods the estimate and plan layouts cost
    assert get_cp_method("usp", ulysses_size=4).options() == {"ulysses_size": 4} and not get_cp_method("ring").options()
    with pytest.raises(ValueError, match="cp_method ring takes no options"):
        get_cp_method("ring", ulysses_size=2)
