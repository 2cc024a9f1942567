"""The qcow2 format as the driver uses it: the header, blank images, allocation maps, layer bitmaps, granularity.

Changed-block tracking stands on this package: each image of a chain keeps
what it changed in a persistent dirty bitmap (`layer_bitmaps`, carried by
`image_bitmaps` through merges), and what a layer holds is read from its
tables (`tables`, `imagemap`) as byte `extents`. The controller turns these
into answers (`csi_qsd.controller.changed_blocks`); `csi_qsd.backup` into
backup files. The header is parsed in one place (`header`), for every
module here that reads an image's own metadata.

May import: errors, sys.
"""
