"""Chapter 0: the roofline measured on this machine (``roofline``) and kernel fusion (``fusion``)."""
