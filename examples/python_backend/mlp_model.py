"""Seed 004's SharedWeightInferenceEngine (Linear -> ReLU -> Linear, then
argmax) as a hearth Python model, in plain PyTorch on the store's one copy
of its weights."""

import torch
import torch.nn.functional as F


class Model:
    def initialize(self, args):
        self.device = torch.device(args["device"])
        w = args["weights"]
        self.encoder = (w["encoder.weight"], w["encoder.bias"])
        self.head = (w["head.weight"], w["head.bias"])
        torch.set_grad_enabled(False)

    def execute(self, inputs):
        x = torch.as_tensor(inputs["input"]).to(self.device, non_blocking=True)
        logits = F.linear(torch.relu(F.linear(x, *self.encoder)), *self.head)
        return {"logits": logits, "argmax": logits.argmax(dim=1, keepdim=True)}
