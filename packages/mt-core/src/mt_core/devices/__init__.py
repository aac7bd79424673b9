"""Built-in device plugins: ``cpu``, ``cuda`` and ``musa``.

Each module is an ordinary mt plugin (it implements ``mt_register_devices``)
registered by :func:`mt_core.get_plugin_manager` under its own name, so
``MT_DISABLED_PLUGINS=cuda`` hides CUDA exactly as it would hide a third-party
plugin.
"""
