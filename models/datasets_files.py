"""Data the user keeps on the worker's file system: an image folder, or a file of token ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def _existing(path: str, kind: str) -> Path:
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"{kind} path '{path}' does not exist on this worker")
    return resolved


def _no_links_out(root: Path, files: list[str], path: str) -> None:
    """ImageFolder follows symlinks inside the folder: every image must still lie under the folder's real path."""
    real_root = root.resolve()
    outside = sum(1 for file in files if real_root not in Path(file).resolve().parents)
    if outside:
        raise PermissionError(f"image_folder '{path}': {outside} of its images are symlinks that lead out of the folder")


class ImageFolderSource:
    """Images in torchvision's ImageFolder layout (root/<class>/<image>; classes sorted by folder name),
    read with PIL on each batch, converted to RGB (channels=3) or grayscale (channels=1), resized to
    image_size x image_size, pixels scaled to [0, 1]."""

    input_kind = "image"

    def __init__(self, *, path: str, image_size: int = 32, channels: int = 3):
        from torchvision import datasets, transforms

        if channels not in (1, 3):
            raise ValueError(f"image_folder reads images as RGB (channels=3) or grayscale (channels=1), not {channels}")
        steps = [transforms.Grayscale(1)] if channels == 1 else []
        transform = transforms.Compose([*steps, transforms.Resize((image_size, image_size)), transforms.ToTensor()])
        root = _existing(path, "image_folder")
        try:
            self.folder = datasets.ImageFolder(str(root), transform=transform)
        except FileNotFoundError:  # torchvision's message lists the folder's sub-folders: not for the client
            raise FileNotFoundError(
                f"image_folder '{path}' needs one sub-folder of images per class (.jpg, .png, ...); none with images was found"
            ) from None
        _no_links_out(root, [sample_path for sample_path, _ in self.folder.samples], path)
        self.image_size = image_size
        self.channels = channels
        self.num_classes = len(self.folder.classes)

    @property
    def shape(self) -> dict[str, int]:
        return {"in_channels": self.channels, "image_size": self.image_size, "num_classes": self.num_classes}

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(0, len(self.folder), (batch_size,), generator=generator)
        images, labels = zip(*(self.folder[i] for i in index.tolist()))
        return torch.stack(images), torch.tensor(labels, dtype=torch.long)


class TokenFile:
    """Random windows of seq_len + 1 tokens from a file: input = window[:-1], target = window[1:].

    A `.bin` file holds uint16 token ids back to back (nanoGPT's prepare.py layout); its vocab_size is
    the given one or, if absent, max id + 1 (one pass over the file). Any other file is read as raw
    bytes, vocab 256. The file is memory-mapped, not loaded.
    """

    input_kind = "tokens"

    def __init__(self, *, path: str, seq_len: int = 64, vocab_size: int | None = None):
        file = _existing(path, "token_file")
        is_bin = file.suffix == ".bin"
        self.tokens = np.memmap(file, dtype=np.uint16 if is_bin else np.uint8, mode="r")
        if len(self.tokens) < seq_len + 1:
            raise ValueError(
                f"token_file '{path}' has {len(self.tokens)} tokens; seq_len {seq_len} needs at least {seq_len + 1}"
            )
        if is_bin:
            self.vocab_size = vocab_size or int(self.tokens.max()) + 1
        elif vocab_size is not None and vocab_size < 256:
            raise ValueError(f"token_file '{path}' holds bytes (vocab 256) but vocab_size is {vocab_size}")
        else:
            self.vocab_size = vocab_size or 256
        self.seq_len = seq_len
        self.path = path

    @property
    def shape(self) -> dict[str, int]:
        return {"vocab_size": self.vocab_size, "seq_len": self.seq_len}

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (batch_size, 1), generator=generator)
        windows = torch.from_numpy(self.tokens[(starts + torch.arange(self.seq_len + 1)).numpy()].astype(np.int64))
        if int(windows.max()) >= self.vocab_size:
            raise ValueError(f"token_file '{self.path}' holds token id {int(windows.max())} >= vocab_size {self.vocab_size}")
        return windows[:, :-1], windows[:, 1:]
