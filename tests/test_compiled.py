import pytest
import torch

from curvlab import hvp, make_loss_fn
from curvlab.models.gpt import GPT, get_config


@pytest.mark.heavy
def test_curvature_of_a_compiled_model_is_the_eager_models():
    torch.manual_seed(0)
    model = GPT(get_config("tiny", vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)).double()
    compiled = torch.compile(model, backend="aot_eager")  # AOTAutograd, as inductor, without a C++ build
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (2, 9), generator=g)
    batch = (idx[:, :-1], idx[:, 1:])
    # the compiled graph itself has no double backward: what curvlab's default method needs
    loss = torch.nn.functional.cross_entropy(compiled(batch[0]).flatten(0, 1), batch[1].flatten())
    grads = torch.autograd.grad(loss, list(compiled.parameters()), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(sum((t * t).sum() for t in grads), list(compiled.parameters()))
    params = {n: p.detach() for n, p in model.named_parameters()}
    compiled_params = {n: p.detach() for n, p in compiled.named_parameters()}
    assert list(compiled_params) == [f"_orig_mod.{n}" for n in params]
    v = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}
    ref = hvp(make_loss_fn(model), params, batch, v)
    lf = make_loss_fn(compiled)
    cv = {f"_orig_mod.{n}": t for n, t in v.items()}
    got = hvp(lf, compiled_params, batch, cv)  # rev_rev, the default
    fwd = hvp(lf, compiled_params, batch, cv, method="fwd_rev")
    for n in params:
        assert torch.equal(got[f"_orig_mod.{n}"], ref[n]), n
        torch.testing.assert_close(fwd[f"_orig_mod.{n}"], ref[n], rtol=1e-10, atol=1e-12)
    # the compiled model still runs as before, outside the curvature code
    out = compiled(batch[0])
    assert torch.equal(out, model(batch[0]))
