"""The block: x0 mix after the embedding's norm, blocks without attention or MLP, the value embeddings' layers."""
import pytest
import torch
import torch.nn.functional as F

from optim.groups import param_roles
from tests.model.tiny import batch, tiny


def test_embed_norm_and_x0_mix_feed_the_normalised_embedding_to_every_block():
    x = batch()
    inputs = []
    for embed_norm in (False, True):
        m = tiny(embed_norm=embed_norm, rotary=True)
        m.blocks[0].register_forward_pre_hook(lambda mod, args: inputs.append(args[0]))
        with torch.no_grad():
            m(x)
            embed = m.wte(x)
        assert torch.equal(inputs.pop(), F.rms_norm(embed, (32,)) if embed_norm else embed)
    m = tiny(x0_mix=True, embed_norm=True, rotary=True)
    plain = tiny(embed_norm=True, rotary=True)
    assert plain.load_state_dict(m.state_dict(), strict=False).unexpected_keys == [
        f"blocks.{i}.x0_lambda" for i in range(4)]
    with torch.no_grad():
        torch.testing.assert_close(m(x)[0], plain(x)[0], atol=0, rtol=0)  # (1, 0) at init: no change
        m.blocks[2].x0_lambda.copy_(torch.tensor([0.5, 2.0]))
        seen = {}
        m.blocks[2].register_forward_pre_hook(lambda mod, args: seen.update(x=args[0], x0=args[1]))
        m.blocks[2].norm1.register_forward_pre_hook(lambda mod, args: seen.update(mixed=args[0]))
        m(x)
    assert torch.equal(seen["x0"], F.rms_norm(m.wte(x), (32,)))
    torch.testing.assert_close(seen["mixed"], 0.5 * seen["x"] + 2.0 * seen["x0"])
    assert [p is m.blocks[2].x0_lambda for p in param_roles(m)["scalar"]].count(True) == 1  # Adam, not Muon


def test_x0_mix_init_starts_the_mixs_first_weight():
    # record 46's 1.1: a block's input is 1.1 x (its x0 weight still 0), so the x0 mix at init is the scaled stream
    m = tiny(x0_mix=True, x0_mix_init=1.1)
    assert all(b.x0_lambda.tolist() == [pytest.approx(1.1), 0.0] for b in m.blocks)
    x = batch()
    seen = {}
    m.blocks[1].register_forward_pre_hook(lambda mod, args: seen.update(x=args[0]))
    m.blocks[1].norm1.register_forward_pre_hook(lambda mod, args: seen.update(mixed=args[0]))
    with torch.no_grad():
        m(x)
    torch.testing.assert_close(seen["mixed"], 1.1 * seen["x"])


@pytest.mark.parametrize("key, gone, kept, lost", [
    ("no_attention", ("attn", "norm1"), ("mlp", "norm2"), 4 * 32 * 32 + 4 * 32 + 2 * 32),
    ("no_mlp", ("mlp", "norm2"), ("attn", "norm1"), 8 * 32 * 32 + 5 * 32 + 2 * 32)])
def test_a_block_without_a_sublayer_has_none_of_its_parameters_and_is_the_other_alone(key, gone, kept, lost):
    plain, m = tiny(), tiny(**{key: [2]})
    block = m.blocks[2]
    assert all(getattr(block, name) is None for name in gone)
    assert [n for n, _ in block.named_parameters()] == [n for n, _ in plain.blocks[2].named_parameters()
                                                        if not n.startswith(tuple(f"{g}." for g in gone))]
    assert m.num_params() == plain.num_params() - lost
    if key == "no_mlp":  # 6 FLOPs less per parameter lost (matmul_weights counts all but the tables)
        assert plain.flops_per_token(16) - m.flops_per_token(16) == 6 * lost
    x, x0 = torch.randn(2, 2, 5, 32, generator=torch.Generator().manual_seed(3))
    sublayer, norm = (getattr(block, name) for name in kept)
    with torch.no_grad():
        h = F.layer_norm(x, (32,), norm.weight, norm.bias)
        other = sublayer(h) if key == "no_attention" else sublayer(h, None, None, None)
        torch.testing.assert_close(block(x, x0, None, None, None), x + other, atol=0, rtol=0)


@pytest.mark.parametrize("options", [{}, dict(window=8, window_pattern="LSSL", doc_causal=True, bos_id=0,
                                              value_embeds=2, unet_skips=True, x0_mix=True, rotary=True)],
                         ids=["baseline", "masks-value-embeds-skips"])
def test_a_model_without_attention_in_a_layer_equals_one_whose_attention_there_adds_nothing(options):
    # with the attention's output projection zeroed, layer 2 of the full model is its MLP alone: the same logits
    # (value embedding table 0, which serves layers 0 and 2, is read by layer 0 only)
    m, plain = tiny(**options, no_attention=[2]), tiny(**options)
    missing = plain.load_state_dict(m.state_dict(), strict=False).missing_keys
    assert missing and all(k.startswith(("blocks.2.attn.", "blocks.2.norm1.")) for k in missing)
    with torch.no_grad():
        plain.blocks[2].attn.proj.weight.zero_()
        plain.blocks[2].attn.proj.bias.zero_()
        idx = batch(B=2, T=20, seed=5).clamp(min=1)
        idx[:, 7] = 0
        torch.testing.assert_close(m(idx)[0], plain(idx)[0], atol=1e-6, rtol=0)


def test_value_embeddings_skip_the_layers_without_attention():
    # table 0 serves layers 0 and 2, table 1 layers 1 and 3: each is left with the layer that has attention
    m = tiny(value_embeds=2, no_attention=[0, 3])
    assert m.cfg.value_embed_layers == [1, 2] and len(m.value_embeds) == 2
    assert all(m.blocks[i].attn.ve_lambda is not None for i in (1, 2))
