"""Muon for the hidden 2-D weights and AdamW for everything else, as one torch optimizer.

[Note: Muon with auxiliary AdamW]
Muon orthogonalises the update of a 2-D weight, and is defined only for hidden matrices: the
embeddings, the output projection, biases and norms keep an element-wise optimizer (AdamW, as
Keller Jordan's MuonWithAuxAdam, DeepSpeed's Muon and torch's own Muon docs do). The config's
``"optimizer": {"type": "Muon"}`` builds this class over two param groups: ``use_muon`` true for
the parameters :func:`muon_param_groups` picks (2-D, name without "embed" or "lm_head" as in
DeepSpeed's rule, and not in any ``nn.Embedding`` or the output embeddings: GPT-2's ``wte`` and
``wpe`` have neither word in their names), false for the rest. The updates are
torch's: each kind of group is stepped by a ``torch.optim.Muon`` or ``torch.optim.AdamW`` that
shares this optimizer's group dicts (so a scheduler writing ``lr`` here reaches them) and its
``state`` (so ``state_dict`` holds both). Muon needs each weight whole, so hf_zero steps this
optimizer with its whole-parameter step ([Note: whole-parameter step]); the AdamW parameters go
the same way, which costs one gather of their gradients per step but keeps one optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Words in a parameter's name that keep it on AdamW (DeepSpeed's rule for "use_muon").
AUX_ADAMW_NAME_WORDS = ("embed", "lm_head")


def muon_param_groups(model: nn.Module, muon_hyper: dict[str, Any],
                      adamw_hyper: dict[str, Any]) -> list[dict[str, Any]]:
    """Two param groups over the trainable parameters of ``model``: Muon's hidden 2-D weights
    (``use_muon`` true) and the rest (false); an empty group is kept so the layout is the same
    for every model."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lookup_tables = [m for m in model.modules() if isinstance(m, nn.Embedding)]  # GPT-2's wte and wpe too
    not_hidden = {id(p) for m in [*lookup_tables, output] if isinstance(m, nn.Module) for p in m.parameters()}
    muon, aux = [], []
    for name, param in model.named_parameters():  # tied weights appear once
        if not param.requires_grad:
            continue
        hidden_matrix = (param.ndim == 2 and id(param) not in not_hidden
                         and not any(word in name.lower() for word in AUX_ADAMW_NAME_WORDS))
        (muon if hidden_matrix else aux).append(param)
    return [dict(muon_hyper, params=muon, use_muon=True), dict(adamw_hyper, params=aux, use_muon=False)]


class MuonWithAuxAdamW(torch.optim.Optimizer):
    """See [Note: Muon with auxiliary AdamW]. Every group needs ``use_muon``; Muon groups take
    torch.optim.Muon's hyperparameters, the others torch.optim.AdamW's."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        missing = [i for i, group in enumerate(param_groups) if "use_muon" not in group]
        if missing:
            raise ValueError(f"MuonWithAuxAdamW: param group(s) {missing} lack 'use_muon' (true for hidden 2-D "
                             "weights, false for the rest); build the groups with hf_zero.engine.optim.muon.muon_param_groups")
        super().__init__(param_groups, {})
        # Each stepper fills its defaults into the groups it is built on (these very dicts);
        # torch refuses an optimizer with no group, so a kind without groups has no stepper.
        self._steppers = [(use_muon, cls(groups)) for use_muon, cls in ((True, torch.optim.Muon), (False, torch.optim.AdamW))
                          if (groups := self._groups(use_muon))]

    def _groups(self, use_muon: bool) -> list[dict[str, Any]]:
        return [g for g in self.param_groups if bool(g["use_muon"]) == use_muon]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for use_muon, stepper in self._steppers:
            # Re-pointed at every step: load_state_dict (which Accelerate calls when it prepares an
            # optimizer) replaces the group dicts and the state, and a scheduler writes the new ones.
            stepper.param_groups = self._groups(use_muon)
            stepper.state = self.state
            stepper.step()
        return loss
