"""ckpt"""
