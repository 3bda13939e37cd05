"""Decoder-only model families: their configs (`config`), which class serves which architecture
(`registry`), the models themselves, and loading their weights (`loader`)."""
