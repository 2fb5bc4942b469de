"""The FLOP count of MFU: parameters by hand, the active parameters of a mixture of experts,
and the PaLM formula written out; the nominal peaks MFU is reported against."""

import pytest
from flax import nnx

from tfx.models import create
from tfx.train.experiments import get_experiment
from tfx.train.flops import nominal_peak_flops, parameter_count, training_flops_per_token


def test_parameter_count_of_char_gpt_by_hand():
    c = get_experiment("gpt_char").model  # 4 layers, d 256, 4 heads of 64, 2 kv heads, ff 1024
    attention = 256 * 256 + 2 * 256 * 128 + 256 * 256
    layer = attention + 3 * 256 * 1024 + 2 * 256  # SwiGLU; two RMSNorm scales
    expected = 4 * layer + 256 * 256 + 256  # tied embedding table, final norm
    assert parameter_count(nnx.state(create(c), nnx.Param)) == expected


def test_experts_count_k_of_e_for_the_active_parameters():
    c = get_experiment("moe_gpt").model  # 8 experts of width 512, top-2, in 4 layers
    params = nnx.state(create(c), nnx.Param)
    experts = 4 * 8 * 3 * 256 * 512
    total = parameter_count(params)
    assert parameter_count(params, config=c) == total - experts * (1 - 2 / 8)
    # The same active parameters per token as char-gpt, plus the routers.
    dense = parameter_count(nnx.state(create(get_experiment("gpt_char").model), nnx.Param))
    assert parameter_count(params, config=c) == dense + 4 * 256 * 8


def test_training_flops_per_token_is_palms_count():
    c = get_experiment("gpt_char").model
    assert training_flops_per_token(c, 1000, 128) == 6 * 1000 + 12 * 4 * 4 * 64 * 128


@pytest.mark.parametrize("kind,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),  # SXM, PCIe datasheets
    ("NVIDIA A100-SXM4-80GB", 312e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12),
    ("NVIDIA RTX A1000", None),  # "A100" must be a whole word of the kind
    ("cpu", None)])  # no nominal peak: MFU is then reported against the measured one alone
def test_nominal_peaks_by_device_kind_are_the_datasheets_dense_bf16_figures(kind, peak):
    assert nominal_peak_flops(kind) == peak
