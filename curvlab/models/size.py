"""A model's size against its weights', before the model is built: a config read from anyone's file can
describe hundreds of gigabytes of parameters for a few kilobytes of weights."""

from __future__ import annotations

from curvlab.errors import CurvlabError

# parameters a model may have beyond twice its weights' values before it is refused unbuilt (64 MB as float32)
SIZE_SLACK = 2**24


def check_model_size(need: int, held: int, what: str) -> None:
    """Raise ``CurvlabError`` if a model of ``need`` parameters, about to be built for weights of ``held``
    values, would be mostly not theirs: more than twice their values and :data:`SIZE_SLACK` more (a few
    kilobytes of weights under a config of ``n_embd=60000`` would allocate hundreds of gigabytes before a
    shape is compared). A smaller difference is left to the checks that name the tensors.

    Args:
        need: the model's parameter count, from its config (a model built on the meta device costs no memory).
        held: the values the weights hold.
        what: the config, for the message: the words before the count (``"x/config.json: describes a
            GPT2LMHeadModel of"``).
    """
    if need > 2 * held + SIZE_SLACK:
        raise CurvlabError(
            f"{what} {need:,} parameters ({4 * need / 1e9:.3g} GB as float32), but the weights hold {held:,} values: "
            "not the weights' model; refusing to build it"
        )
