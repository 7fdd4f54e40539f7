"""Integrations with training frameworks, each imported only by its public module (``dq.torchtitan``)."""
