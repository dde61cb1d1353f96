"""The model section: unknown keys and bad values are refused with the reason, TOML integers serve float keys, and
the vocabulary is padded up to a multiple of VOCAB_MULTIPLE; field_value, the one type check of a raw value against a
field, and the Literal helpers."""
from typing import Literal

import pytest

from model import GPTConfig, get_model
from model.config import choices, config_from_dict, field_value
from tests.helpers import TINY_GPT as TINY


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['n_embed', 'rope'\].*valid keys are.*'n_embd'"):
        get_model({"model": {**TINY, "n_embed": 64, "rope": True}})


@pytest.mark.parametrize("bad, message", [
    (dict(norm="batchnorm"), "norm='batchnorm'; use 'layernorm' or 'rmsnorm'"),
    (dict(n_head=3), "n_embd=32 must be a multiple of n_head=3"),
    (dict(value_embeds=3), r"value_embeds=3 needs 0 <= 2 \* value_embeds <= n_layer=4"),
    (dict(attention="flash"), "attention='flash'; use 'sdpa' or 'flex'"),
    (dict(n_layer="4"), "n_layer='4' must be of type int"),
    (dict(rotary=1), "rotary=1 must be of type bool"),
    (dict(window=True), "window=True must be of type int"),
    (dict(attn_scale=-1.0), "attn_scale must be >= 0"),
    (dict(rope_truncate=True), "rope_truncate needs rotary = true"),
    (dict(rotary=True, rope_truncate=True, n_head=4, n_embd=24), "head size divisible by 4, got 6"),
    (dict(window=8, window_start=16), "window_start=16 must be at most window=8"),
    (dict(window_pattern="LS"), "window_pattern='LS' needs window > 0 and only the letters L and S"),
    (dict(window=8, window_pattern="LSX"), "window_pattern='LSX' needs"),
    (dict(no_attention=[4]), r"no_attention=\[4\] must list distinct layer indices in \[0, n_layer=4\), e.g. \[7\]"),
    (dict(no_attention=[-1]), r"no_attention=\[-1\] must list distinct layer indices"),
    (dict(no_attention=[1, 1]), r"no_attention=\[1, 1\] must list distinct"),
    (dict(no_attention=[True]), r"no_attention=\[True\] must list distinct"),
    (dict(no_attention=7), "no_attention=7 must be of type list"),
    (dict(no_mlp=[4]), r"no_mlp=\[4\] must list distinct layer indices in \[0, n_layer=4\), e.g. \[0\]"),
    (dict(no_mlp=[2], no_attention=[1, 2]), r"layer\(s\) \[2\] are in both no_attention and no_mlp"),
    (dict(mudd=[4]), r"mudd=\[4\] must list distinct layer indices in \[0, n_layer=4\), e.g. \[9\]"),
    (dict(mudd=[2, 2]), r"mudd=\[2, 2\] must list distinct"),
    (dict(mudd=[3], mudd_sources=[-1]), r"mudd_sources=\[-1\] must list distinct layer indices in \[0, n_layer=4\)"),
    (dict(mudd=[1], mudd_sources=[0, 2]), r"mudd_sources=\[0, 2\]: layer\(s\) \[2\] come after every layer in "
                                          r"mudd=\[1\], so no MUDD connection reads them; remove them"),
    (dict(mudd_sources=[0]), r"mudd_sources=\[0\]: layer\(s\) \[0\] come after every layer in mudd=\[\]"),
    (dict(ve_gate=True), "ve_gate = true gates the value embeddings, and value_embeds = 0 has none: set "
                         "value_embeds > 0 or ve_gate = false"),
    (dict(skip_gate=True), "skip_gate = true gates the U-net skips, and unet_skips = false has none: set "
                           "unet_skips = true or skip_gate = false"),
    (dict(backout=4), r"backout=4 must count the blocks whose residual the head backs out, 0 \(off\) to "
                      r"n_layer - 1 = 3, e.g. 8"),
    (dict(backout=-1), "backout=-1 must count the blocks"),
    (dict(yarn=True, window=8, window_start=2), r"yarn = true rescales the rotary frequencies as the window grows: "
                                                r"it needs rotary = true and a window that starts \(window_start or "
                                                r"window_stages\[0\]\) above 0 and below window, got rotary = False, "
                                                r"start = 2, window = 8"),
    (dict(yarn=True, rotary=True, window=8), "yarn = true rescales.*start = 0, window = 8"),
    (dict(yarn=True, rotary=True, window=8, window_start=8), "yarn = true rescales.*start = 8, window = 8"),
    (dict(yarn=True, rotary=True, window=8, window_stages=[8]), "yarn = true rescales.*start = 8, window = 8"),
    (dict(value_embeds=1, no_attention=[0, 3]), r"value_embeds=1: table\(s\) \[0\] would serve only layers with no "
                                                r"attention \(no_attention=\[0, 3\]\); lower value_embeds"),
    (dict(xsa=[4]), r"xsa=\[4\] must list distinct layer indices in \[0, n_layer=4\), e.g. \[1\]"),
    (dict(xsa=[1, 2], no_attention=[2]), r"xsa=\[1, 2\]: layer\(s\) \[2\] have no attention \(no_attention=\[2\]\); "
                                          r"remove them from xsa"),
    (dict(bigram_hash=1), r"bigram_hash=1 must be 0 \(off\) or at least 2 rows"),
    (dict(bigram_hash=-3), r"bigram_hash=-3 must be 0 \(off\) or at least 2 rows .* e.g. 251520"),
    (dict(bigram_hash=100, bigram_dim=33), r"bigram_dim=33 must be in \[0, n_embd=32\]"),
    (dict(bigram_signs=True), "bigram_dim=0 and bigram_signs=True shape the bigram table, which bigram_hash = 0 turns "
                              "off: set bigram_hash > 0"),
    (dict(bigram_dim=8), "bigram_dim=8 and bigram_signs=False shape the bigram table"),
    (dict(untie_at=1.0), r"untie_at=1.0 must lie in \[0, 1\): the training progress at which the head unties"),
    (dict(untie_at=-0.5), r"untie_at=-0.5 must lie in \[0, 1\)"),
    (dict(untie_at=0.5, tie_embeddings=False), "untie_at=0.5 unties a tied head, but tie_embeddings = false: set "
                                                "tie_embeddings = true"),
    (dict(mtp_weights=[0.5, 1.0]), r"mtp_weights=\[0.5, 1.0\] must be \[\] \(the next token alone\) or the next "
                                   r"token's weight 1.0 followed by .*e.g. \[1.0, 0.5, 0.25\]"),
    (dict(mtp_weights=[1.0, -0.5]), r"mtp_weights=\[1.0, -0.5\] must be \[\]"),
    (dict(mtp_weights=[1.0, "x"]), r"mtp_weights=\[1.0, 'x'\] must be \[\]"),
    (dict(mtp_weights=[True]), r"mtp_weights=\[True\] must be \[\]"),
    (dict(prefix_weight=-0.25), "prefix_weight=-0.25 must be >= 0"),
    (dict(fp8_head=True, n_embd=40), "fp8_head = true multiplies through torch._scaled_mm, whose CUDA kernels need "
                                     r"n_embd=40 to be a multiple of 16: change n_embd \(768"),
    (dict(fp8_head=True, untie_at=0.5), r"fp8_head = true casts the head's weights at a fixed scale, which a head "
                                        r"tied to the token table outgrows as the table trains: set tie_embeddings "
                                        r"= false \(record 46's head"),
    (dict(x0_mix_init=1.1), "x0_mix_init=1.1 starts the x0 mix, and x0_mix = false has none: set x0_mix = true"),
    (dict(embed_init_std=1.0), "embed_init_std=1.0 would also start the tied head at that std: set "
                               r"tie_embeddings = false \(record 46\)"),
    (dict(embed_init_std=-1.0, tie_embeddings=False), r"embed_init_std=-1.0 must be >= 0"),
    (dict(init_std=-1.0), r"init_std=-1.0 must be >= 0, the std of the init \(GPT-2's: 0.02\)"),
    (dict(rotary=True, rope_base=0.0), r"rope_base=0.0 must be > 0, the rotary base frequency \(10000.0; the records: "
                                       r"1024.0\)"),
    (dict(rotary=True, rope_base=-5.0), r"rope_base=-5.0 must be > 0"),
    (dict(skip_connection=[2, 1]), r"skip_connection=\[2, 1\] must be \[\] or \[a, b\], 0 <= a < b < n_layer=4: "
                                   r"block a's output into block b's input, e.g. \[3, 6\]"),
    (dict(skip_connection=[0, 4]), r"skip_connection=\[0, 4\] must be"),
    (dict(skip_connection=[1]), r"skip_connection=\[1\] must be"),
    (dict(skip_connection=[0, True]), r"skip_connection=\[0, True\] must be"),
    (dict(value_embeds=1, value_embed_skip=2), r"value_embed_skip=2 must be in \[0, value_embeds=1\]: the tables that "
                                               r"serve the last layers alone, e.g. 1 \(record 46"),
    (dict(value_embed_skip=-1), r"value_embed_skip=-1 must be in \[0, value_embeds=0\]"),
    (dict(value_embeds=2, value_embed_skip=1, no_attention=[2]),
     r"value_embeds=2: table\(s\) \[0\] would serve only layers with no attention"),
])
def test_bad_values_are_explained(bad, message):
    with pytest.raises(ValueError, match=message):
        get_model({**TINY, **bad})


def test_toml_integer_for_a_float_key_is_accepted():
    assert get_model({**TINY, "logit_softcap": 15}).cfg.logit_softcap == 15.0


@pytest.mark.parametrize("vocab, padded", [(32000, 32000), (50257, 50304), (257, 384), (128, 128)])
def test_vocab_padding(vocab, padded):
    assert GPTConfig(vocab_size=vocab).padded_vocab == padded


@pytest.mark.parametrize("hint, value, want", [
    (float, 15, 15.0), (float, 0.5, 0.5), (int, 3, 3), (bool, True, True), (str, "x", "x"),
    (list[float], (0.9, 0.95), [0.9, 0.95]), (Literal["a", "b"], "c", "c"),  # choices are checked apart
])
def test_a_value_of_the_field_type_is_taken_as_the_field_holds_it(hint, value, want):
    got = field_value(hint, value)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("hint, value, name", [
    (int, True, "int"), (float, False, "float"), (int, 1.0, "int"), (bool, 1, "bool"), (str, 3, "str"),
    (list[float], 0.9, "list"), (Literal["a", "b"], 1, "str"),
])
def test_a_value_of_another_type_names_the_field_type(hint, value, name):
    with pytest.raises(TypeError) as e:
        field_value(hint, value)
    assert str(e.value) == name


def test_choices_are_the_literal_values_and_a_checkpoint_dict_is_checked_by_the_same_rule():
    assert choices(Literal["sdpa", "flex"]) == ("sdpa", "flex") and choices(int) == ()
    assert config_from_dict({"logit_softcap": 15, "n_layer": 2}) == GPTConfig(logit_softcap=15.0, n_layer=2)
