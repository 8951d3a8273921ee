"""fp8_wgmma's tile variants without a GPU: each is a valid compiled tile that fits one block a SM, invalid ones are
refused with the reason, and `choose` weighs the last wave's idle SMs (the kernels run in
tests/gpu/test_fp8_kernels.py)."""

import pytest

from kernels_cu import fp8_wgmma
from kernels_cu.fp8_wgmma import VARIANTS, Variant


def test_variants_fit_and_compile_options_name_the_tile():
    for name, v in VARIANTS.items():
        assert v.smem_bytes() <= 227 * 1024, name
        assert f"-DFLLAMA_FP8_WGMMA_BN={v.bn}" in v.options(), name
        regs = v.bn // 2 + v.chunks * (v.bn // v.rounds // 2) + (16 if v.rs else 0)
        assert regs <= 208, f"{name}: registers for acc, chunks and x"


@pytest.mark.parametrize("args,match", [((160, 2, 2, 5), "no wgmma"), ((256, 2, 3, 4), "chunk sets"),
                                        ((192, 4, 2, 5), "no wgmma"), ((256, 2, 1, 5), "do not fit"),
                                        ((256, 2, 1, 2), "do not fit"), ((256, 2, 2, 4), "208 registers")])
def test_invalid_variants_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        Variant(*args)


def test_choose_weighs_the_last_wave():
    def cost(name: str, m: int, n: int, sms: int) -> float:
        v = VARIANTS[name]
        return -(-(-(-m // 128) * -(-n // v.bn)) // sms) * v.bn / v.speed

    for m, n in [(2048, 4096), (2048, 12288), (2048, 22016), (512, 4096), (130, 4096)]:
        got = fp8_wgmma.choose(m, n, 132)
        assert cost(got, m, n, 132) == min(cost(name, m, n, 132) for name in VARIANTS), (m, n, got)
