"""A Hugging Face sequence-classification reward model, scored in batches in the driver process."""

from __future__ import annotations

import torch


class RewardModel:
    def __init__(self, path: str, batch_size: int = 32) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size

    def text(self, prompt: str, response: str) -> str:
        """What the model reads: the conversation in its own chat template when it has one (reward
        models are trained on templated chats), else the plain concatenation."""
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt + response

    @torch.no_grad()
    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """The first logit of the model for each (prompt, response), ``batch_size`` at a time."""
        scores: list[float] = []
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        for start in range(0, len(pairs), self.batch_size):
            texts = [self.text(p, r) for p, r in pairs[start : start + self.batch_size]]
            enc = self.tokenizer(
                texts, return_tensors="pt", padding=True, truncation=True, add_special_tokens=not templated
            )
            scores.extend(self.model(**enc).logits[:, 0].float().tolist())
        return scores
