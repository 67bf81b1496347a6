"""Evaluation: decoding and the metrics, the evaluator on the mesh, do_predict, translation with an
exported model, and scoring a model on FLORES-style files (`python -m trainer.evaluate`)."""
