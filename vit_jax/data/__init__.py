"""Where images come from (embedded data, image folders, tfds) and their tf.data batches."""
