"""The feature browser: which images, and which patches of them, make each atom fire.

``python -m sae_pipeline features`` (:mod:`sae_pipeline.features.cli`) streams a dataset once
through a trained SAE on any number of devices (:mod:`.pass_module`, :mod:`.topn`,
:mod:`.merge`), re-reads the top images' tokens for the heatmaps and the images themselves
from the extraction's recorded source (:mod:`.images`), and writes a static site
(:mod:`.site` builds it: the index, :mod:`.index_page`, and a page per atom, :mod:`.atom_pages`;
:mod:`.site_dir` checks ``--out``, builds beside it and swaps the site in whole),
with a page per image of the atoms that fire most on it and of each clicked patch's atoms
(:mod:`.image_top`, :mod:`.image_pages`, :mod:`.patch_atoms`)
and, where the images carry labels, per-atom label statistics and a page per label (:mod:`.labels`
counts in the pass, :mod:`.selectivity`, :mod:`.label_pages`, :mod:`.label_assets`).
``features explain`` (:mod:`.explain`, the command; :mod:`.explain_backbone`, :mod:`.explain_images`,
:mod:`.explain_pages`) writes those image pages for new images, through the backbone the SAE's
training data was extracted with.
``features --intervene`` (:mod:`.interventions`, :mod:`.interventions_html`) removes atoms inside that backbone on
their top images, against a matched removal.
:mod:`.tensorboard` logs the top patches of a few atoms during training.
"""
