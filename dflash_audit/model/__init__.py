"""The DFlash drafter: config, anchors, mask, model, loss, metrics, checkpoint."""
