"""layer_input=choose: each layer's search input picked, per layer, by the error it leaves.

From layer 1 on, the layer is searched twice: on the previous layer's output with its float weights (AutoAWQ's
input) and with its scaled and clipped weights (fllama's SCALED). Each result is folded and rounded as the
checkpoint holds it, run on the quantized model's own hidden states, and judged by the mean squared distance of
its output to the float model's; the closer one is kept, and its input is the stream the next layer's candidates
are computed from. The judge reads the search tokens themselves: it picks one of two searches, one bit per
layer, so it has little to overfit. Twice the search cost of a fixed layer_input.
"""

from __future__ import annotations

from typing import Callable

import torch

from calibrate.awq import apply_awq, search_layer
from calibrate.awq_config import AwqConfig, AwqLayerResult, LayerInput
from calibrate.capture import LayerwiseRunner
from model_zoo.weights import LayerWeights

CANDIDATES = (LayerInput.SCALED, LayerInput.FLOAT)  # SCALED first: it keeps a tie (the measured default)


class InputChooser:
    """Beside the search stream (`runner`), the float model's and the quantized model's hidden states, and the
    candidate inputs of the next layer's search, all [n, L, H] on the host."""

    def __init__(self, runner: LayerwiseRunner, float_run: LayerwiseRunner, quant_run: LayerwiseRunner,
                 quantize: Callable[[LayerWeights], LayerWeights]):
        self.runner, self.float_run, self.quant_run, self.quantize = runner, float_run, quant_run, quantize
        self.candidates: dict[LayerInput, torch.Tensor] = {}  # empty for layer 0: its input is the embeddings

    @torch.no_grad()
    def search(self, layer: LayerWeights, cfg: AwqConfig) -> AwqLayerResult:
        """The layer's search on the candidate input whose quantized output lands closest to the float model's;
        losses get "input.<candidate>" for each and `chosen_input` says which won."""
        config = self.runner.config
        if not self.candidates:
            return search_layer(layer, config, self.runner.hidden, cfg)
        target = _forward(self.float_run, layer)  # [n, L, H]: the float model's output of this layer
        searched, losses = {}, {}
        for choice in CANDIDATES:
            result = search_layer(layer, config, self.candidates[choice], cfg)
            got = _forward(self.quant_run, self.quantize(apply_awq(layer, result, config)))  # [n, L, H]
            searched[choice], losses[f"input.{choice.value}"] = result, float((got - target).pow(2).mean())
        choice = min(CANDIDATES, key=lambda c: losses[f"input.{c.value}"])  # the first of equals: SCALED
        result = searched[choice]
        result.losses.update(losses)
        result.chosen_input = choice.value
        self.runner.hidden = self.candidates[choice]
        return result

    def advance(self, original: LayerWeights, scaled: LayerWeights, quantized: LayerWeights) -> None:
        """After a layer is decided: the next layer's candidates from this layer's chosen input, and the float
        and quantized streams one layer on."""
        x = self.runner.hidden
        self.candidates = {}
        for choice, layer in ((LayerInput.SCALED, scaled), (LayerInput.FLOAT, original)):
            self.runner.hidden = x.clone()
            self.runner.run_layer(layer)
            self.candidates[choice] = self.runner.hidden
        self.runner.hidden = x  # until search() picks one
        self.float_run.run_layer(original)
        self.quant_run.run_layer(quantized)


def _forward(run: LayerwiseRunner, layer: LayerWeights) -> torch.Tensor:
    """layer(run.hidden) [n, L, H], leaving run.hidden as it was."""
    x = run.hidden
    run.hidden = x.clone()
    run.run_layer(layer)
    y, run.hidden = run.hidden, x
    return y
