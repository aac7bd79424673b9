"""A fake third-party accelerator for mt's plugin tests (see ``plugin``)."""
