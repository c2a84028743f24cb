"""Loading pretrained weights under ZeRO-3 without any rank holding the whole model."""
