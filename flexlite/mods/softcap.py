"""Tanh soft-capping of attention scores (Gemma 2, Grok): cap * tanh(score / cap)."""


def generate_tanh_softcap(cap: float):
    import torch

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    softcap.__name__ = f"tanh_softcap_{cap:g}"
    return softcap
