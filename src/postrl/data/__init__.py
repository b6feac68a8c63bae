from postrl.data.dataset import DatasetError, PromptDataset, load_prompt_dataset
from postrl.data.sampler import PromptSampler

__all__ = ["DatasetError", "PromptDataset", "PromptSampler", "load_prompt_dataset"]
