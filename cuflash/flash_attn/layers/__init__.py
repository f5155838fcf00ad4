"""flash-attn's ``flash_attn.layers`` helpers that its users import (``rotary``)."""
