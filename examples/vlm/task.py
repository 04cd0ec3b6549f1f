"""The LightningModule that trains the example VLM on next-caption-token prediction."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from .model import VLM, VLMConfig

# The config is saved with the hyperparameters: let torch.load(weights_only=True),
# which Lightning uses to resume, rebuild it.
torch.serialization.add_safe_globals([VLMConfig])


class VLMTask(L.LightningModule):
    """Caption loss on the text tokens; image tokens carry no loss.

    Logs ``train/loss`` every step, and on the held-out split ``val/loss``,
    ``val/acc`` (caption-token accuracy) and ``val/ppl`` (perplexity). The
    torchmetrics metrics accumulate counts on every rank and reduce them across
    ranks when the epoch ends, so under DDP they equal the single-process value.

    Args:
        config: the model's shape (see :class:`VLMConfig` and its presets).
        pad_id: the tokenizer's padding id; padded positions carry no loss.
        lr: peak AdamW learning rate.
        warmup_steps: linear warm-up, then constant.
        weight_decay: AdamW weight decay on matrices (not on biases, norms, embeddings).
    """

    def __init__(
        self,
        config: VLMConfig,
        pad_id: int = 0,
        lr: float = 3e-3,
        warmup_steps: int = 50,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = config
        self.pad_id = pad_id
        self.lr = lr
        self.warmup_steps = warmup_steps
        self.weight_decay = weight_decay
        self.model = VLM(config)
        self.val_acc = MulticlassAccuracy(config.vocab_size, average="micro", ignore_index=pad_id)
        self.val_ppl = Perplexity(ignore_index=pad_id)

    def forward(self, images: Tensor, input_ids: Tensor) -> Tensor:
        logits: Tensor = self.model(images, input_ids)
        return logits

    def _logits_and_targets(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        ids = batch["input_ids"]
        logits = self(batch["images"], ids[:, :-1])  # predict token t+1 from tokens <= t
        return logits, ids[:, 1:]

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=self.pad_id)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        if batch["input_ids"].shape[0] == 0:  # every sample of this batch was undecodable
            return None
        logits, targets = self._logits_and_targets(batch)
        loss = self._loss(logits, targets)
        self.log("train/loss", loss, prog_bar=True, batch_size=targets.shape[0])
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        if batch["input_ids"].shape[0] == 0:
            return
        logits, targets = self._logits_and_targets(batch)
        batch_size = targets.shape[0]
        self.log("val/loss", self._loss(logits, targets), sync_dist=True, batch_size=batch_size)
        self.val_acc(logits.flatten(0, 1), targets.flatten())
        self.val_ppl(logits, targets)
        self.log("val/acc", self.val_acc, batch_size=batch_size)
        self.log("val/ppl", self.val_ppl, batch_size=batch_size)

    def configure_optimizers(self) -> Any:
        decay: list[Tensor] = []
        no_decay: list[Tensor] = []
        for p in self.model.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 and not _is_embedding(self.model, p) else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.lr,
            betas=(0.9, 0.98),
        )
        warmup = max(1, self.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _is_embedding(model: VLM, param: Tensor) -> bool:
    lm = model.language_model
    return (
        param is lm.embed_tokens.weight
        or param is lm.embed_positions.weight
        or param is model.vision.pos_embed
    )
