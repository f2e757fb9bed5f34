import torch


def documents(lengths, device="cpu"):
    ids = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])

    def same_document(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    return same_document
