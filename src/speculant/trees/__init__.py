"""Token trees as values: their buffers and masks, and the search for a tree from measured accuracies."""
