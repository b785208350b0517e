"""The AMX tile kernels give the VNNI kernels' numbers bit for bit: emulated on every CPU, on the tiles themselves
where the CPU and the kernel grant them."""

import numpy as np
import pytest

from bench.kernels import store_as
from decoding.kernels.amx import EMULATED, HARDWARE, TILE_TOKENS, tile_activations, tile_scratch
from decoding.kernels.fast_kernels import activation_arrays, matmul_groups, quantize_activation_rows, swiglu_groups
from decoding.kernels.kernels import GATE_SILU
from decoding.kernels.repack import repack
from decoding.model.quant import QType

PACKED_TYPES = [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q6_K, QType.Q4_K]
WIDEST = 768  # the scratch is wider than the matrices, as the engine's is


def quantized(x: np.ndarray, mode: int):
    tokens, cols = x.shape
    xq, xd, xsum = activation_arrays(tokens, WIDEST)
    tiles = tile_activations(mode, tokens, WIDEST, TILE_TOKENS)
    quantize_activation_rows(x, cols, 0, tokens, xq, xd, xsum, tiles, tokens)
    return xq, xd, xsum, tiles


def matmul(packed, qtype, rows, x, mode, accumulate=False):
    tokens, cols = x.shape
    xq, xd, xsum, tiles = quantized(x, mode)
    out = np.full((tokens, rows), 0.25, np.float32)
    matmul_groups(packed, int(qtype), cols, xq, xd, xsum, tokens, out, 0, rows // 8, accumulate,
                  np.zeros((8, 8), np.float32), tiles, tile_scratch(1, mode, WIDEST, tokens)[0, 0])
    return out


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32))


def weights(qtype: QType, rows: int, cols: int, seed: int):
    rng = np.random.default_rng(seed)
    stored = store_as(rng.standard_normal((rows, cols)).astype(np.float32), qtype, rng)
    return repack(stored, qtype, rows, cols)


def tile_modes():
    from decoding.kernels.amx_probe import tile_support

    support = tile_support()  # skipped only where the CPU or Linux refuse the tiles, not where they compute wrong
    hardware = pytest.param(HARDWARE, id="hardware", marks=pytest.mark.skipif(
        not support.available, reason=f"AMX tiles not usable here: {support.reason}"))
    return [pytest.param(EMULATED, id="emulated"), hardware]


@pytest.mark.parametrize("mode", tile_modes())
@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("tokens", [16, 37, 70])  # 70: a pass of four tiles over each unpacked pair, a remainder
def test_tiles_give_the_vnni_kernels_bits(mode, qtype, tokens):
    rows, cols = 40, 512  # five 8-row groups: two tile calls of two and one of one
    packed = weights(qtype, rows, cols, int(qtype) * 7 + tokens)
    x = np.random.default_rng(tokens).standard_normal((tokens, cols)).astype(np.float32) * 3
    x[3, :64] = 0.0  # a token with all-zero blocks: scale 0
    vector = matmul(packed, qtype, rows, x, 0)
    tiled = matmul(packed, qtype, rows, x, mode)
    assert np.isfinite(vector).all() and np.abs(vector).max() > 0
    assert_same_bits(tiled, vector)
    assert_same_bits(matmul(packed, qtype, rows, x, mode, accumulate=True),
                     matmul(packed, qtype, rows, x, 0, accumulate=True))


def test_calls_of_fewer_than_two_tiles_run_on_the_vector_kernels_on_hardware():
    """On hardware a call takes the tiles from FEWEST_TILED_TOKENS on (below, unpacking each pair of groups for one
    tile costs more than it saves); the emulation takes them from one tile, to test their numbers."""
    from decoding.kernels.amx import FEWEST_TILED_TOKENS
    from decoding.kernels.fast_kernels import tiled_tokens

    hardware = tile_activations(HARDWARE, 128, 256)
    assert hardware.fewest_tokens == FEWEST_TILED_TOKENS == 2 * TILE_TOKENS
    assert [tiled_tokens(hardware, n, 256) for n in (16, 31, 32, 37, 128)] == [0, 0, 32, 32, 128]
    emulated = tile_activations(EMULATED, 128, 256)
    assert [tiled_tokens(emulated, n, 256) for n in (15, 16, 37)] == [0, 16, 32]
    assert tiled_tokens(tile_activations(0, 128, 256), 128, 256) == 0


def test_rows_too_long_for_a_pass_of_the_fewest_tokens_never_take_the_tiles():
    """Where a pass of TILE_PASS_BYTES holds fewer than the fewest tokens (a 32B's down projection, 27,648 columns,
    one tile a pass), no pass could take the tiles: the call runs without them, whatever its length."""
    from decoding.kernels.fast_kernels import tiled_tokens, tokens_per_pass

    hardware = tile_activations(HARDWARE, 512, 27648)
    assert tokens_per_pass(27648, True) < hardware.fewest_tokens <= tokens_per_pass(18944, True)
    assert tiled_tokens(hardware, 512, 27648) == 0
    assert tiled_tokens(hardware, 512, 18944) == 512


@pytest.mark.parametrize("mode", tile_modes())
def test_a_call_below_its_fewest_tokens_gives_the_same_bits_without_tiles(mode):
    rows, cols, tokens = 16, 256, 40
    packed = weights(QType.Q6_K, rows, cols, 11)
    x = np.random.default_rng(12).standard_normal((tokens, cols)).astype(np.float32)
    xq, xd, xsum = activation_arrays(tokens, cols)
    tiles = tile_activations(mode, tokens, cols, fewest_tokens=48)
    quantize_activation_rows(x, cols, 0, tokens, xq, xd, xsum, tiles, tokens)
    assert not tiles.xq.any()  # the tiles' copy is not even written
    out, scratch = np.zeros((tokens, rows), np.float32), tile_scratch(1, mode, cols, tokens)[0, 0]
    matmul_groups(packed, int(QType.Q6_K), cols, xq, xd, xsum, tokens, out, 0, rows // 8, False,
                  np.zeros((8, 8), np.float32), tiles, scratch)
    assert_same_bits(out, matmul(packed, QType.Q6_K, rows, x, 0))
    assert not scratch.any()  # no group was unpacked, no tile's products written


@pytest.mark.parametrize("mode", tile_modes())
def test_a_long_rows_passes_of_fewer_tiles_than_the_fewest_run_without_tiles(mode):
    """A matrix whose rows are so long that a pass holds one tile (its activations fill TILE_PASS_BYTES) runs
    on the VNNI kernels where the fewest tokens are two tiles, though the call has many more."""
    from decoding.kernels.fast_kernels import tokens_per_pass

    rows, cols, tokens = 8, 256 * 88, 64
    assert tokens_per_pass(cols, True) == TILE_TOKENS
    packed = weights(QType.Q4_K, rows, cols, 13)
    x = np.random.default_rng(14).standard_normal((tokens, cols)).astype(np.float32)
    results = []
    for fewest in (TILE_TOKENS, 2 * TILE_TOKENS):
        xq, xd, xsum = activation_arrays(tokens, cols)
        tiles = tile_activations(mode, tokens, cols, fewest_tokens=fewest)
        quantize_activation_rows(x, cols, 0, tokens, xq, xd, xsum, tiles, tokens)
        out, scratch = np.zeros((tokens, rows), np.float32), tile_scratch(1, mode, cols, tokens)[0, 0]
        matmul_groups(packed, int(QType.Q4_K), cols, xq, xd, xsum, tokens, out, 0, 1, False,
                      np.zeros((8, 8), np.float32), tiles, scratch)
        assert scratch.any() == (fewest == TILE_TOKENS)  # one tile a pass: through the tiles only from one on
        assert tiles.xq.any() == (fewest == TILE_TOKENS)  # nor are the activations copied for them
        results.append(out)
    assert np.abs(results[0]).max() > 0
    assert_same_bits(results[1], results[0])


@pytest.mark.parametrize("mode", tile_modes())
def test_a_token_gets_the_same_bits_alone_and_in_a_tile(mode):
    rows, cols = 32, 256
    packed = weights(QType.Q4_K, rows, cols, 5)
    x = np.random.default_rng(6).standard_normal((21, cols)).astype(np.float32)
    together = matmul(packed, QType.Q4_K, rows, x, mode)
    for t in (0, 7, 15, 20):
        assert_same_bits(together[t], matmul(packed, QType.Q4_K, rows, x[t : t + 1], mode)[0])


@pytest.mark.parametrize("mode", tile_modes())
def test_the_gated_feed_forward_through_tiles_gives_the_same_bits(mode):
    rows, cols, tokens = 40, 256, 19
    gate, up = weights(QType.Q4_K, rows, cols, 8), weights(QType.Q6_K, rows, cols, 9)
    x = np.random.default_rng(10).standard_normal((tokens, cols)).astype(np.float32)
    results = []
    for m in (0, mode):
        xq, xd, xsum, tiles = quantized(x, m)
        out, up_out = np.zeros((tokens, rows), np.float32), np.zeros((tokens, rows), np.float32)
        swiglu_groups(gate, up, int(QType.Q4_K), int(QType.Q6_K), cols, xq, xd, xsum, tokens, out, up_out, 0,
                      rows // 8, np.zeros((8, 8), np.float32), np.zeros((8, 8), np.float32), GATE_SILU, tiles,
                      tile_scratch(1, m, WIDEST, tokens)[0])
        results.append(out)
    assert np.abs(results[0]).max() > 0
    assert_same_bits(results[1], results[0])


def step_logits(model, kernels: str) -> list[np.ndarray]:
    """Logits of three mixed steps (whole prompts of 16+ tokens, a chunk, decodes): tiles and a remainder."""
    from tests.test_forward_step import StepDriver

    rng = np.random.default_rng(4)
    prompts = {1: rng.integers(3, model.config.vocab_size, 40).tolist(),
               2: rng.integers(3, model.config.vocab_size, 25).tolist()}  # fmt: skip
    driver = StepDriver(model, 2, kernels=kernels)
    try:
        for s, ids in prompts.items():
            driver.add(s, ids)
        steps = [{1: 37, 2: 16}, {1: 1, 2: 9}, {1: 1, 2: 0}]
        return [np.concatenate(list(driver.step({s: n for s, n in work.items() if n}).values()))
                for work in steps]  # fmt: skip
    finally:
        driver.close()


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K, QType.Q8_0, QType.Q4_0], ids=lambda q: q.name)
def test_the_model_step_through_emulated_tiles_gives_the_same_logits(tmp_path_factory, monkeypatch, qtype):
    """The whole step's tile path (the activations' second layout, every projection, the gated feed-forward,
    the LM head) against the vector kernels, bit for bit."""
    from tests.test_forward_step import tiny_model

    model = tiny_model(tmp_path_factory, qtype)
    vector = step_logits(model, "fast-no-amx")
    monkeypatch.setenv("TREADLE_AMX", "emulate")
    tiled = step_logits(model, "fast")
    assert np.isfinite(vector[0]).all()
    for a, b in zip(tiled, vector, strict=True):
        assert_same_bits(a, b)


def test_where_the_cpu_grants_tiles_the_start_up_check_passes():
    from decoding.kernels.amx_probe import tile_support

    support = tile_support()
    if not support.available:
        pytest.skip(f"AMX tiles not usable here: {support.reason}")
    assert support.granted, support.reason


def test_the_start_up_check_compares_every_type_with_the_vector_kernels():
    from decoding.kernels.amx_probe import check_tiles

    assert check_tiles(EMULATED) == []


def test_the_child_process_check_says_why_it_failed():
    """The check a server runs before using tiles, run as the server runs it (a child process)."""
    from decoding.kernels.amx_probe import _check_in_child, tile_support

    failure = _check_in_child()
    if tile_support().available:
        assert failure is None
    else:  # Linux refuses the tile state to the child: the message says so
        assert failure is not None and "arch_prctl" in failure


def test_the_tiles_are_chosen_only_for_fast_and_logged(monkeypatch, caplog):
    from decoding.kernels.amx_probe import tile_support
    from decoding.kernels.forward import tile_mode

    monkeypatch.delenv("TREADLE_AMX", raising=False)
    with caplog.at_level("INFO", logger="decoding.kernels.forward"):
        assert tile_mode("fast") == (HARDWARE if tile_support().granted else 0)
    assert "AMX tiles: " in caplog.text and (tile_support().reason in caplog.text or tile_support().granted)
    assert tile_mode("fast-no-amx") == 0 and tile_mode("exact") == 0
    monkeypatch.setenv("TREADLE_AMX", "emulate")
    assert tile_mode("fast") == EMULATED and tile_mode("fast-no-amx") == 0


def test_the_hardware_kernel_is_built_on_every_cpu():
    """The tile instructions are compiled everywhere (AMX in the kernel's own target features), so the code is
    the same on every machine; where AMX is missing they are never run."""
    from numba import njit

    from decoding.kernels.amx import UNPACKED_FLOATS_PER_BLOCK, tile_products_with_mins, unpack_q4_k

    @njit  # not cached: numba keeps no assembly for cached code
    def one_tile(packed, n_blocks, tiles, unpacked, out):
        unpack_q4_k(packed, 0, 0, n_blocks, unpacked)
        tile_products_with_mins(unpacked, n_blocks, tiles, 0, 1, out)

    rows, cols = 8, 256
    _, _, _, tiles = quantized(np.zeros((16, cols), np.float32), EMULATED)
    unpacked, out = np.zeros(cols // 32 * UNPACKED_FLOATS_PER_BLOCK, np.float32), np.zeros((1, 16, 16), np.float32)
    one_tile(weights(QType.Q4_K, rows, cols, 1), cols // 32, tiles, unpacked, out)
    asm = one_tile.inspect_asm(one_tile.signatures[0])
    for instruction in ("ldtilecfg", "tileloadd", "tdpbusd", "tilestored", "tilerelease"):
        assert instruction in asm
    assert "prefetcht0" in asm  # the weights ahead, as the VNNI kernels ask for them


def tile_product(tiles_class):
    """An njit function c = tdpbusd(0, a, b) run by `tiles_class`'s instructions on the configured A0/B0/C0."""
    from numba import njit, types
    from numba.extending import intrinsic

    from decoding.kernels.amx import A0, B0, C0, TILE_SHAPES
    from decoding.kernels.vnni import array_byte_pointer

    @intrinsic
    def product(typingctx, a, b, c):
        def codegen(context, builder, signature, args):
            pointers = [array_byte_pointer(context, builder, t, v) for t, v in zip(signature.args, args, strict=True)]
            tiles = tiles_class(builder)
            tiles.configure()
            tiles.load(A0, pointers[0], TILE_SHAPES[A0][1])
            tiles.load(B0, pointers[1], TILE_SHAPES[B0][1])
            tiles.zero(C0)
            tiles.dot(C0, A0, B0)
            tiles.store(C0, pointers[2], TILE_SHAPES[C0][1])
            tiles.release()
            return context.get_dummy_value()

        return types.void(a, b, c), codegen

    @njit
    def run(a, b, c):
        product(a, b, c)

    return run


def test_the_emulated_tile_product_is_the_intel_manuals_tdpbusd():
    """TDPBUSD as the SDM defines it: C[m][n] += Σ_k Σ_j A[m][4k+j] (unsigned) · B[k][4n+j] (signed), for the
    configured shapes (A 16 × 32 bytes, B 8 × 64, C 16 × 16 int32) — the emulation the kernel is tested through."""
    from decoding.kernels.amx import A0, B0, C0, TILE_SHAPES, _EmulatedTiles

    (m, k_bytes), (k_words, _), (_, n_words) = TILE_SHAPES[A0], TILE_SHAPES[B0], (0, TILE_SHAPES[C0][1] // 4)
    rng = np.random.default_rng(12)
    a = rng.integers(0, 256, (m, k_bytes), dtype=np.uint8)
    b = rng.integers(-128, 128, (k_words, 4 * n_words), dtype=np.int8)
    c = np.zeros((m, n_words), np.int32)
    tile_product(_EmulatedTiles)(a, b, c)
    expected = np.einsum("mkj,knj->mn", a.reshape(m, k_words, 4).astype(np.int64),
                         b.reshape(k_words, n_words, 4).astype(np.int64))  # fmt: skip
    np.testing.assert_array_equal(c, expected)
    a[:] = 255
    b[:] = -128  # the extremes: no saturation, no overflow at these sizes
    tile_product(_EmulatedTiles)(a, b, c)
    assert (c == k_bytes * 255 * -128).all()


def test_the_hardware_tile_product_is_the_emulations():
    from decoding.kernels.amx import A0, B0, C0, TILE_SHAPES, _EmulatedTiles, _HardwareTiles
    from decoding.kernels.amx_probe import tile_support

    if not tile_support().available:
        pytest.skip(f"AMX tiles not usable here: {tile_support().reason}")
    rng = np.random.default_rng(13)
    a = rng.integers(0, 256, TILE_SHAPES[A0], dtype=np.uint8)
    b = rng.integers(-128, 128, TILE_SHAPES[B0], dtype=np.int8)
    results = []
    for tiles_class in (_EmulatedTiles, _HardwareTiles):
        c = np.zeros((TILE_SHAPES[C0][0], TILE_SHAPES[C0][1] // 4), np.int32)
        tile_product(tiles_class)(a, b, c)
        results.append(c)
    np.testing.assert_array_equal(results[1], results[0])
