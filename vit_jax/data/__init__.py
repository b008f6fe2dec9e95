"""Where images come from (embedded data, image folders, tfds) and their tf.data batches; a
user's image and class-name files for the tools."""
