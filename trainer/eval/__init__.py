"""Evaluation: decoding and scoring, the evaluator on the mesh, do_predict, translation with an exported model."""
