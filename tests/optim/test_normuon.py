"""NorMuon: equal RMS per neuron with the matrix's norm kept, rows or columns by shape, views apart (also of
several sizes), rows held by several ranks, and Muon's resume with the second moments."""
import pytest
import torch

from optim.muon import Muon, lr_scale, newton_schulz
from optim.normuon import _rescaled, _square_sums, moment_size, normalize


def rms(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.square().mean(dim).sqrt()


@pytest.mark.parametrize("beta2", [0.0, 0.95])
@pytest.mark.parametrize("shape, neurons", [((32, 8), 1), ((8, 32), 0)])  # tall: rows; wide: columns
def test_every_neuron_gets_the_same_rms_and_the_norm_is_kept(shape, neurons, beta2):
    torch.manual_seed(0)
    # neurons of very different sizes, as an orthogonalised update has them
    o = torch.randn(shape) * torch.logspace(-1, 1, shape[1 - neurons]).view((-1, 1) if neurons else (1, -1))
    moment = torch.zeros(moment_size(torch.Size(shape), 1))
    assert moment.shape == (shape[1 - neurons],)
    # the first step (the moment starts at zero: 1 - beta2 cancels); with beta2 = 0, every step
    for step in range(3 if beta2 == 0 else 1):
        v = o * (1 + step)
        out, = normalize([v], [torch.Size(shape)], [1], [0], [moment], [beta2])
        torch.testing.assert_close(rms(out, neurons), torch.full((shape[1 - neurons],), rms(v.flatten(), 0)))
        torch.testing.assert_close(out.norm(), v.norm())
    if beta2:  # later the moment remembers: B = (1 - beta2) (beta2 s_0 + s_1), here with s_1 = 4 s_0
        normalize([2 * o], [torch.Size(shape)], [1], [0], [moment], [beta2])
        s0 = o.square().mean(neurons)
        torch.testing.assert_close(moment, (1 - beta2) * (beta2 + 4) * s0)


def test_split_views_are_normalised_apart():
    torch.manual_seed(0)
    o = torch.randn(3 * 6, 16) * torch.tensor([1.0, 10.0, 0.1]).repeat_interleave(6)[:, None]
    moment = torch.zeros(moment_size(o.shape, 3))
    assert moment.shape == (3 * 16,)  # [6, 16] views are wide: their columns are the neurons
    out, = normalize([o], [o.shape], [3], [0], [moment], [0.9])
    for view, whole in zip(out.chunk(3), o.chunk(3)):
        alone, = normalize([whole], [whole.shape], [1], [0], [torch.zeros(16)], [0.9])
        torch.testing.assert_close(view, alone)
        torch.testing.assert_close(view.norm(), whole.norm())


def test_with_normuon_columns_each_views_neurons_are_its_columns_as_record_46s_attention():
    # record 46's NorMuon of one attention view V [d, d] after a zero moment: s_j = mean_i V_ij^2 per column j,
    # B = (1 - beta2) s, V' = V / sqrt(B), then V' * |V| / |V'|; here one Muon step on a qkv of three such views
    torch.manual_seed(0)
    d, lr, beta2 = 8, 0.05, 0.9
    w, g = torch.randn(3 * d, d), torch.randn(3 * d, d) * torch.logspace(-1, 1, d)
    want = []
    for view in newton_schulz(g.view(3, d, d)):
        scaled = view / ((1 - beta2) * view.square().mean(0, keepdim=True)).sqrt()
        want.append(scaled * view.norm() / scaled.norm())
    got = {}
    for columns in (True, False):
        p = torch.nn.Parameter(w.clone())
        p.grad = g.clone()
        Muon([p], lr=lr, momentum=0.0, adjust_lr="none", split=3, normuon=True, normuon_beta2=beta2,
             normuon_columns=columns).step()
        got[columns] = p.detach()
    torch.testing.assert_close(got[True], w - lr * torch.cat(want), atol=1e-6, rtol=0)
    assert not torch.allclose(got[False], got[True])  # square views: by rows otherwise


def test_views_of_several_sizes_keep_moments_of_their_own_neurons():
    # Q and K in pairs of heads, [4, 8] (wide: 8 column neurons each), V [8, 8] (square: its 8 rows)
    torch.manual_seed(0)
    split, rows = (4, 4, 4, 4, 8), [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16), slice(16, 24)]
    o = torch.randn(24, 8) * torch.logspace(-1, 1, 24)[:, None] * torch.logspace(1, -1, 8)
    moment = torch.zeros(moment_size(o.shape, split))
    assert moment.shape == (5 * 8,)
    for _ in range(2):  # the second step reads the moments the first left
        out, = normalize([o], [o.shape], [split], [0], [moment], [0.9])
    for i, r in enumerate(rows):
        alone = torch.zeros(8)
        for _ in range(2):
            want, = normalize([o[r]], [o[r].shape], [1], [0], [alone], [0.9])
        torch.testing.assert_close(out[r], want)
        torch.testing.assert_close(moment[8 * i:8 * (i + 1)], alone)
    torch.testing.assert_close(rms(out[:4], 0), torch.full((8,), rms(o[:4].flatten(), 0)))  # a pair: per column
    torch.testing.assert_close(rms(out[16:], 1), torch.full((8,), rms(o[16:].flatten(), 0)))  # V: per row


@pytest.mark.parametrize("shape, split, ranks", [((33, 16), 3, 2), ((15, 4), 1, 2), ((30, 8), (6, 6, 18), 2),
                                                 ((30, 8), (3, 3, 24), 4)])
def test_rows_held_by_several_ranks_sum_to_the_whole(shape, split, ranks):
    # what one all_reduce of the ranks' sums gives (FSDP2 shards rows like torch.chunk, across view boundaries;
    # on 4 ranks of 8 rows, the first holds rows of all three views of (3, 3, 24), wide and tall)
    torch.manual_seed(0)
    o, shape = torch.randn(shape), torch.Size(shape)
    want, = normalize([o], [shape], [split], [0], [torch.zeros(moment_size(shape, split))], [0.9])
    pieces = o.chunk(ranks)
    starts = [r * -(-shape[0] // ranks) for r in range(len(pieces))]
    sums = sum(_square_sums(piece, shape, split, start) for piece, start in zip(pieces, starts))
    got = [_rescaled(piece, sums, torch.zeros(moment_size(shape, split)), 0.9, shape, split, start)
           for piece, start in zip(pieces, starts)]
    torch.testing.assert_close(torch.cat(got), want)


def test_muon_steps_by_the_normalised_update():
    torch.manual_seed(0)
    w, g = torch.randn(24, 8), torch.randn(24, 8) * torch.linspace(0.1, 3, 24)[:, None]
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    Muon([p], lr=0.05, momentum=0.0, normuon=True).step()
    step = (w - p.detach()) / (0.05 * lr_scale(w.shape, "original"))
    torch.testing.assert_close(rms(step, 1), torch.full((24,), rms(newton_schulz(g).flatten(), 0)))


def _run(params, grads, opt):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def test_resume_restores_the_second_moments_exactly(tmp_path):
    torch.manual_seed(0)
    weights = [torch.randn(12, 8), torch.randn(8, 12)]
    grads = [[torch.randn_like(w) * torch.rand(w.size(0), 1) for w in weights] for _ in range(4)]
    hp = dict(lr=0.05, normuon=True, normuon_beta2=0.5, ns_coefficients="polar_express", cautious_wd=True,
              weight_decay=0.1)
    straight = [torch.nn.Parameter(w.clone()) for w in weights]
    _run(straight, grads, Muon(straight, **hp))
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Muon(params, **hp)
    _run(params, grads[:2], opt)
    assert [tuple(opt.state[p]["second_moment"].shape) for p in params] == [(12,), (12,)]
    torch.save({"params": [p.detach() for p in params], "optim": opt.state_dict()}, tmp_path / "resume.pt")
    saved = torch.load(tmp_path / "resume.pt", weights_only=True)
    for restore in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
        opt = Muon(params, **hp)
        opt.load_state_dict(saved["optim"])
        if not restore:  # the momentum buffers alone: the second moments are what the run then lacks
            for p in params:
                opt.state[p]["second_moment"].zero_()
        _run(params, grads[2:], opt)
        assert all(torch.equal(a, b) for a, b in zip(params, straight)) == restore
