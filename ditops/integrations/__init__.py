"""Integrations with model libraries. Each is imported on its own (``ditops.integrations.diffusers``);
importing ditops imports none of them."""
