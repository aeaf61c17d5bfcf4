"""Mixture-of-experts models: how their routers route inside the trainer's forward, what they
did (expert load, router entropy), and routing replay.

A router here is transformers' top-k router of a sparse block (Qwen3-MoE's Qwen3MoeTopKRouter,
transformers 5.5 and 5.19): forward(hidden (..., H)) -> (router logits (N, E), the k gate
weights (N, k), the k expert ids (N, k)), N the forward's positions in the order of the flattened
(B*T) input. `routing` swaps each router's forward for one that computes the same: the logits,
their softmax in fp32, the top k, their weights renormalised over k where the model's config
says so (norm_topk_prob), cast back to the logits' dtype. Given routing replaces the top k's ids
only: the gate weights are then the router's own softmax at the given experts, so the router
keeps its gradient (routing replay, "R3": the engine's experts for each token, the trainer's
gates for them).

Routing replay matters because the engine and the trainer compute the same router logits in
different kernels; where two experts' logits are close, they pick different experts for the
same token, and the engine/trainer logprob gap of a mixture of experts grows with every such
token. Replayed, the trainer runs the experts that sampled the token. The engine returns its
routing where vLLM's `enable_return_routed_experts` works (docs/engine.md, "Routing replay");
config.validate refuses model.routing_replay elsewhere.
"""

import contextlib
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def routers(model: torch.nn.Module) -> list:
    """The model's top-k routers, in the order of its layers (module order)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


def is_moe(config) -> bool:
    """Whether a model config (transformers', or its config.json as a dict) is a mixture of
    experts: it names its experts' count."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    text = get("text_config", None)
    if text is not None:
        return is_moe(text)
    return bool(get("num_experts", 0) or get("num_local_experts", 0) or get("n_routed_experts", 0))


@dataclass
class RouterStats:
    """What the routers did over the positions `valid` marks, summed over forwards: per layer,
    the positions each expert took (load, (L, E)), the sum of the routers' entropy (nats) and the
    positions counted; with given routing, the positions whose own top k (as a set) differs from
    the given one. Tensors stay on the device until `totals`."""
    load: list = field(default_factory=list)
    entropy: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    differs: list = field(default_factory=list)

    def add(self, layer: int, probs, own, used, valid) -> None:
        while len(self.load) <= layer:
            for part in (self.load, self.entropy, self.positions, self.differs):
                part.append(None)
        p, w = probs[valid], valid.sum()
        load = torch.zeros(probs.shape[1], device=probs.device).index_add_(
            0, used[valid].reshape(-1), torch.ones_like(used[valid].reshape(-1), dtype=torch.float))
        entropy = -(p * torch.log(p.clamp(min=torch.finfo(p.dtype).tiny))).sum()
        differs = (own.sort(1).values != used.sort(1).values).any(1)[valid].sum()
        for part, x in ((self.load, load), (self.entropy, entropy), (self.positions, w),
                        (self.differs, differs)):
            part[layer] = x if part[layer] is None else part[layer] + x

    def totals(self) -> dict:
        """{"ratio": each layer's max/mean of the experts' load, "entropy": the routers' entropy
        summed over layers and positions, "positions": positions counted over layers, "differs":
        positions whose experts were replaced with another set}, from one read back; {} if no
        router ran."""
        if not self.load:
            return {}
        load = torch.stack(self.load).float()  # (L, E)
        n = len(self.load)
        flat = torch.cat([load.max(1).values / load.mean(1).clamp(min=1e-12)] + [
            torch.stack(part).float().reshape(-1)
            for part in (self.entropy, self.positions, self.differs)]).tolist()
        ratio, entropy, positions, differs = (flat[i * n:(i + 1) * n] for i in range(4))
        return {"ratio": ratio, "entropy": sum(entropy), "positions": sum(positions),
                "differs": sum(differs)}


def _route(self, hidden_states, layer: int, given, stats, valid):
    """A router's forward, as transformers' Qwen3MoeTopKRouter computes it, with given[layer]
    (N, k) ids where >= 0 in place of its own top k."""
    h = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(h, self.weight)  # (N, E)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    weights, own = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
    used = own
    if given is not None:
        g = given[layer]
        used = torch.where(g >= 0, g, own)
        weights = probs.gather(1, used)
    if self.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if stats is not None:
        with torch.no_grad():
            stats.add(layer, probs.detach(), own, used,
                      valid if valid is not None else torch.ones_like(own[:, 0], dtype=torch.bool))
    return logits, weights.to(logits.dtype), used


@contextlib.contextmanager
def routing(model: torch.nn.Module, given: torch.Tensor | None = None,
            stats: RouterStats | None = None, valid: torch.Tensor | None = None):
    """Inside, the model's routers route by `given` (L, N, k) long, layer l's experts for each
    of the forward's N flattened positions, -1 where the router keeps its own (None: its own
    everywhere), and add what they did to `stats` over the positions `valid` (N,) bool marks
    (None: all). Leaving it, the routers are as transformers built them."""
    found = routers(model)
    for layer, router in enumerate(found):
        router.forward = types.MethodType(
            lambda self, h, _layer=layer: _route(self, h, _layer, given, stats, valid), router)
    try:
        yield found
    finally:
        for router in found:
            del router.forward


def given_routing(samples: list, starts: torch.Tensor, positions: int) -> torch.Tensor | None:
    """The engine's routing of `samples` (records.Sample.routing: (P + R - 1, L, k), each
    position's experts, the last token never ran through the engine) laid out for one forward:
    (L, positions, k) long, sample i's position j at starts[i] + j, -1 where no routing is known
    (padding, the last token, a sample without routing). None if no sample has routing."""
    have = [s for s in samples if getattr(s, "routing", None) is not None]
    if not have:
        return None
    layers, k = have[0].routing.shape[1:]
    out = torch.full((layers, positions, k), -1, dtype=torch.long)
    for s, start in zip(samples, starts.tolist()):
        if getattr(s, "routing", None) is not None:
            r = torch.as_tensor(s.routing, dtype=torch.long)  # (n, L, k)
            out[:, start:start + r.shape[0]] = r.permute(1, 0, 2)
    return out
