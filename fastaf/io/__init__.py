"""Adapter files in PEFT's layout (``adapter_model.safetensors`` + ``adapter_config.json``), read
and written atomically, locally or on the Hugging Face Hub."""
from typing import Any

from .files import check_adapter_name, read_adapter, read_adapter_and_name, save_adapter


def upload_folder_to_hub(*args: Any, **kwargs: Any) -> Any:
    """``hub.upload_folder_to_hub``, imported at the first upload: huggingface_hub costs ~0.3 s
    to import, and only hub users need it."""
    from .hub import upload_folder_to_hub as upload

    return upload(*args, **kwargs)
