"""Weight-only quantization on tiny models: what gets quantized, losslessness of DFlash on a
quantized target, on-the-fly mode, and the saved-folder round trip (runtime API)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open
from torch import nn

from runtime import LoadOptions, ModelRef, RuntimeConfig, SamplingParams, load_pipeline
from runtime.engine.models.target import TargetModel
from runtime.errors import ConfigError, ModelLoadError
from runtime.models.quant_schemes import (
    SCHEMES,
    AlreadyQuantizedError,
    MissingLibraryError,
    check_supported,
    get_scheme,
    quantize_model_inplace,
    weight_bytes,
)
from runtime.models.quantized import QUANT_KEY, read_saved_quantization
from runtime.quantize.job import QuantizeRequest, quantize_pair
from runtime.quantize.report import agreement, measure_pair, prefix_share, report_prompts
from tests.fakes import (
    OracleDecoder,
    collect_ids,
    greedy_pair,
    greedy_reference,
    lean_greedy_reference,
    make_drafter,
    make_target,
)

CPU = RuntimeConfig(device="cpu", dtype="float32")
TORCHAO = ("int8", "int4")


def plain(t) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and type(t.data) is torch.Tensor


def opts(tmp_path, **kw) -> LoadOptions:
    return LoadOptions(models_dir=tmp_path / "models", offline=True, **kw)


def logits(pipe, ids) -> torch.Tensor:
    with torch.inference_mode():
        return pipe.target.model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("scheme", TORCHAO)
def test_every_linear_but_the_head_is_quantized(scheme):
    model = make_target("qwen3", vocab_size=96, seed=0)
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.inference_mode():
        before = model(input_ids=x).logits
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    summary = quantize_model_inplace(model, scheme, "cpu")
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            assert plain(m.weight) == (name == "lm_head"), name
    assert plain(model.get_input_embeddings().weight)
    assert (summary.quantized, summary.kept_float) == (n_linear - 1, 1)
    assert summary.bytes_after < summary.bytes_before == weight_bytes(make_target("qwen3", vocab_size=96))
    with torch.inference_mode():
        after = model(input_ids=x).logits
    assert not torch.equal(before, after)  # really quantized ...
    assert torch.isfinite(after).all()  # ... and still a working model
    again = quantize_model_inplace(model, scheme, "cpu")  # nothing left to quantize
    assert again.quantized == 0


def test_int4_weighs_less_than_int8():
    sizes = {}
    for scheme in TORCHAO:
        model = make_target("qwen3", vocab_size=96, seed=0)
        sizes[scheme] = quantize_model_inplace(model, scheme, "cpu").bytes_after
    assert sizes["int4"] < sizes["int8"]


@pytest.mark.parametrize("scheme", TORCHAO)
def test_dflash_on_quantized_target_equals_its_plain_greedy(scheme):
    """Lossless with respect to the quantized target: every acceptance length, random drafter too."""
    model = make_target("qwen3", vocab_size=96, seed=3)
    quantize_model_inplace(model, scheme, "cpu")
    target = TargetModel(model)
    drafter = make_drafter(model.config, block_size=6)
    quantize_model_inplace(drafter, scheme, "cpu")  # a quantized drafter changes acceptance only
    params = SamplingParams(max_new_tokens=16)
    rng = random.Random(scheme)
    taus = []
    for i in range(3):
        p = [rng.randrange(96) for _ in range(rng.randint(2, 10))]
        ref = greedy_reference(model, p, 16)  # cache-free greedy of the quantized model
        assert greedy_pair(target, drafter, p, 16) == (ref, ref)
        events = list(OracleDecoder(target, drafter, corrupt=0.3, seed=i).stream(p, params))
        assert collect_ids(events) == ref
        taus.append(events[-1].stats.tau)
    assert max(taus) > 2  # multi-token verify blocks on quantized weights were exercised


@pytest.mark.parametrize("scheme", TORCHAO)
def test_on_the_fly_quantize_option(tiny_pair, tmp_path, scheme):
    t, d = tiny_pair
    ref = ModelRef(target=str(t), drafter=str(d))
    base = load_pipeline(ref, CPU, opts(tmp_path))
    quant = load_pipeline(ref, CPU, opts(tmp_path, quantize=scheme))
    assert base.quantization is None and quant.describe()["quantization"] == scheme
    assert not plain(quant.target.model.model.layers[0].mlp.up_proj.weight)
    assert plain(quant.drafter.layers[0].mlp.up_proj.weight)  # --quantize is for the target only
    ids = [5, 6, 7, 8, 9]
    assert not torch.equal(logits(base, ids), logits(quant, ids))
    params = SamplingParams(max_new_tokens=16)
    dflash = collect_ids(list(quant.stream(ids, params)))
    # int8 on the lean forward runs ATen's int8 GEMM with an int8 head: its own numbers, so its own
    # cache-free greedy decoding is the reference; other schemes run the quantized modules as they are
    ref = lean_greedy_reference(quant.target, ids, 16) if quant.target.int8 else None
    assert dflash == (ref or greedy_reference(quant.target.model, ids, 16))
    assert quant.target.int8 == (scheme == "int8")


@pytest.fixture(scope="module")
def saved(tiny_pair, tmp_path_factory):
    """The tiny pair quantized with each torchao scheme (target and drafter) by quantize_pair."""
    t, d = tiny_pair
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for scheme in TORCHAO:
        req = QuantizeRequest(
            scheme=scheme,
            out=root / scheme,
            ref=ModelRef(target=str(t), drafter=str(d)),
            runtime=CPU,
            load=LoadOptions(models_dir=root / "models", offline=True),
            quantize_drafter=True,
        )
        out[scheme] = quantize_pair(req)
    return out


@pytest.mark.parametrize("scheme", TORCHAO)
def test_saved_folder_round_trip(saved, tiny_pair, tmp_path, scheme):
    res = saved[scheme]
    t, d = tiny_pair
    assert res.reload_max_diff == 0.0
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg[QUANT_KEY]["scheme"] == scheme and cfg[QUANT_KEY]["library"] == "torchao"
    assert (res.out / "tokenizer.json").exists() and (res.out / "chat_template.jinja").exists()
    assert not list(res.out.parent.glob(f".{res.out.name}.partial-*"))
    loaded = load_pipeline(ModelRef(target=str(res.out), drafter=str(res.drafter_out)), CPU, opts(tmp_path))
    assert loaded.quantization == scheme
    assert not plain(loaded.target.model.model.layers[1].self_attn.q_proj.weight)
    assert not plain(loaded.drafter.layers[0].self_attn.q_proj.weight)
    assert plain(loaded.target.model.lm_head.weight)
    # the folder loads to exactly what on-the-fly quantization of the original gives
    fly = load_pipeline(ModelRef(target=str(t), drafter=str(d)), CPU, opts(tmp_path, quantize=scheme))
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(logits(loaded, ids), logits(fly, ids))
    params = SamplingParams(max_new_tokens=12)
    assert collect_ids(list(loaded.stream(ids, params))) == collect_ids(list(fly.stream(ids, params)))


def test_int8_folder_is_stored_quantized_and_smaller(saved):
    res = saved["int8"]
    assert res.stored_quantized and res.disk_after < res.disk_before
    with safe_open(str(res.out / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert "I8" in dtypes
    # torchao's safetensors format: plain transformers reads it back quantized
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(res.out), local_files_only=True)
    assert type(m.model.layers[0].mlp.down_proj.weight).__name__ == "Int8Tensor"


def test_int4_folder_keeps_float_weights_and_records_the_scheme(saved):
    res = saved["int4"]
    assert not res.stored_quantized and res.disk_after == res.disk_before
    assert res.memory_after < saved["int8"].memory_after < res.memory_before
    saved_q = read_saved_quantization(res.out)
    assert saved_q is not None and saved_q.scheme == "int4" and not saved_q.stored_quantized


def test_report_measures_both_pairs(tiny_pair, tmp_path):
    t, d = tiny_pair
    req = QuantizeRequest(
        scheme="int8",
        out=tmp_path / "q",
        ref=ModelRef(target=str(t), drafter=str(d)),
        runtime=CPU,
        load=opts(tmp_path),
        report=True,
        report_tokens=10,
        report_prompts=2,
    )
    rep = quantize_pair(req).report
    assert rep is not None and rep.prompts == 2 and rep.max_new_tokens == 10
    for side in (rep.base, rep.quantized):
        assert side.dflash is not None and side.dflash.generated_tokens == side.ar.generated_tokens == 20
        assert side.lossless is True
        assert side.dflash.tau >= 1.0 and side.ar.tokens_per_second > 0
    assert 0.0 <= rep.agreement <= 1.0 and 0.0 <= rep.prefix_match <= 1.0
    json.dumps(rep.to_json())


def test_agreement_of_a_target_with_its_own_greedy_output_is_total(tiny_pair, tmp_path):
    t, _d = tiny_pair
    pipe = load_pipeline(ModelRef(target=str(t), drafter="none"), CPU, opts(tmp_path))
    prompts = report_prompts(pipe, 2)
    runs = measure_pair(pipe, prompts, 8)
    assert runs.dflash is None and runs.speedup is None
    assert agreement(pipe, prompts, runs.ar.tokens) == 1.0
    shifted = [tuple(list(r[1:]) + [r[0]]) for r in runs.ar.tokens]  # off by one: must not match fully
    assert agreement(pipe, prompts, shifted) < 1.0


def test_prefix_share():
    assert prefix_share([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert prefix_share([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert prefix_share([9, 2, 3, 4], [1, 2, 3, 4]) == 0.0


# -- errors ------------------------------------------------------------------------------------------


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(ConfigError, match="int8, int4, q4, bnb-int8, bnb-nf4"):
        get_scheme("int3")
    assert get_scheme(" INT8 ").name == "int8"


@pytest.mark.parametrize("scheme", ["bnb-int8", "bnb-nf4"])
def test_bitsandbytes_schemes_need_cuda(scheme):
    with pytest.raises(ConfigError, match="needs a CUDA GPU.*int8 or int4"):
        check_supported(SCHEMES[scheme], torch.device("cpu"), torch.float32)


def test_int4_on_cuda_needs_bfloat16():
    with pytest.raises(ConfigError, match="bfloat16"):
        check_supported(SCHEMES["int4"], torch.device("cuda"), torch.float16)


def test_int4_config_per_device_and_layer_width():
    """The CUDA path cannot run here; at least its torchao config must build (no GPU in CI)."""
    from runtime.models.quant_schemes import _torchao_config, import_torchao

    import_torchao()
    cpu = _torchao_config("int4", torch.device("cpu"), 896)
    cuda = _torchao_config("int4", torch.device("cuda"), 4864)
    assert type(cpu).__name__ == "PrototypeInt4WeightOnlyConfig" and cpu.group_size == 128
    assert type(cuda).__name__ == "Int4WeightOnlyConfig" and cuda.int4_packing_format.value == "tile_packed_to_4d"
    assert _torchao_config("int4", torch.device("cpu"), 96).group_size == 32
    assert _torchao_config("int4", torch.device("cpu"), 100) is None  # kept in float


def test_missing_library_names_the_install_command(monkeypatch):
    import runtime.models.quant_schemes as q

    monkeypatch.setattr(q, "library_installed", lambda name: False)
    with pytest.raises(MissingLibraryError, match="pip install bitsandbytes"):
        check_supported(SCHEMES["bnb-nf4"], torch.device("cuda"), torch.bfloat16)
    with pytest.raises(MissingLibraryError, match=r"pip install 'dflash-code\[quantize\]'"):
        check_supported(SCHEMES["int8"], torch.device("cpu"), torch.float32)


def test_quantizing_a_quantized_folder_is_refused(saved, tmp_path):
    res = saved["int8"]
    with pytest.raises(AlreadyQuantizedError, match="already quantized"):
        load_pipeline(ModelRef(target=str(res.out), drafter="none"), CPU, opts(tmp_path, quantize="int4"))
    req = QuantizeRequest(
        scheme="int4", out=tmp_path / "again", ref=ModelRef(target=str(res.out), drafter="none"), runtime=CPU
    )
    with pytest.raises(AlreadyQuantizedError):
        quantize_pair(req)
    assert not (tmp_path / "again").exists()


def test_folder_with_unknown_recorded_scheme(saved, tmp_path):
    import shutil

    folder = tmp_path / "future"
    shutil.copytree(saved["int4"].out, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[QUANT_KEY]["scheme"] = "int3"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="int3"):
        load_pipeline(ModelRef(target=str(folder), drafter="none"), CPU, opts(tmp_path))
