"""Evaluation harnesses: MileBench (`milebench`) and the offline multimodal needle benchmark (`needle`)."""
